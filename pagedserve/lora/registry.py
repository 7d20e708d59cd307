"""The adapters an engine knows: each request's adapter checked against the model before it is queued (a broken
directory fails its request, never a step), and the adapters a server serves by name (`add`, `remove`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from pagedserve.lora.adapter import AdapterSpec
from pagedserve.lora.request import LoRARequest


class AdapterRegistry:
    def __init__(self, enabled: bool, read: Callable[[str], AdapterSpec]) -> None:
        """`read`: an adapter directory checked against the model (`adapter.read_adapter` with its shapes)."""
        self.enabled = enabled
        self._read = read
        self._checked: dict[int, LoRARequest] = {}  # by lora_int_id: the adapters requests ran with
        self.by_name: dict[str, LoRARequest] = {}  # the served adapters
        self._ids = itertools.count(1)

    def check(self, lora: LoRARequest) -> None:
        """ValueError naming the problem where a request cannot run with `lora`."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request={lora!r} must be a LoRARequest")
        if not self.enabled:
            raise ValueError(f"lora_request={lora.lora_name!r}: adapters need an engine with enable_lora=True")
        known = self._checked.get(lora.lora_int_id)
        if known is not None:
            if known.lora_path != lora.lora_path:
                raise ValueError(f"lora_request.lora_int_id={lora.lora_int_id} already stands for the adapter at "
                                 f"{known.lora_path!r}, not {lora.lora_path!r}: each adapter needs an id of its own")
            return
        self._read(lora.lora_path)
        self._checked[lora.lora_int_id] = lora

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as `name` (checked now); ValueError naming the problem."""
        if not self.enabled:
            raise ValueError(f"lora adapter {name!r}: adapters need an engine with enable_lora=True")
        if name in self.by_name:
            raise ValueError(f"lora_name={name!r} is already loaded")
        # An id never used before: blocks cached under an adapter once served by this name stay its own.
        lora = LoRARequest(name, self._fresh_id(), path)
        self.check(lora)
        self.by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        """Stop serving adapter `name` (requests running with it finish); KeyError when none is."""
        return self.by_name.pop(name)

    def _fresh_id(self) -> int:
        return next(i for i in self._ids if i not in self._checked)
