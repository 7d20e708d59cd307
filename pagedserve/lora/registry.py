"""The adapters an engine has run: each request's adapter checked against the model before it is queued (a broken
directory fails its request, never a step)."""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.lora.adapter import AdapterSpec
from pagedserve.lora.lora_request import LoRARequest


class AdapterRegistry:
    def __init__(self, enabled: bool, read: Callable[[str], AdapterSpec]) -> None:
        """`read`: an adapter directory checked against the model (`adapter.read_adapter` with its shapes)."""
        self.enabled = enabled
        self._read = read
        self._checked: dict[int, LoRARequest] = {}  # by lora_int_id: the adapters requests ran with

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
        self.read(lora.lora_path)
        self._checked[lora.lora_int_id] = lora

    def read(self, path: str) -> AdapterSpec:
        """The adapter directory at `path` checked against the model (ValueError naming the problem)."""
        if not self.enabled:
            raise ValueError(f"lora adapter {path!r}: adapters need an engine with enable_lora=True")
        return self._read(path)
