"""Which adapter each of the workers' `max_loras` slots holds: the scheduler's record, so that the workers never
decide. A sequence runs only with its adapter in a slot; a slot whose adapter no running sequence uses may take
another adapter, the least recently used first, and the step that first uses it tells the workers to load it
(`StepBatch.lora_loads`)."""

from __future__ import annotations

import itertools

from pagedserve.lora.lora_request import LoRARequest


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.adapters: list[LoRARequest | None] = [None] * num_slots  # by slot
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)

    def slot_of(self, adapter: LoRARequest) -> int | None:
        for slot, held in enumerate(self.adapters):
            if held is not None and held.lora_int_id == adapter.lora_int_id:
                return slot
        return None

    def acquire(self, adapter: LoRARequest, in_use: set[int]) -> tuple[int, bool] | None:
        """A slot for `adapter` and whether the workers must load it there; None when every slot holds an adapter
        of `in_use` (ids that running sequences use). A free slot goes first, then the least recently used."""
        slot = self.slot_of(adapter)
        load = slot is None
        if load:
            free = [s for s, held in enumerate(self.adapters) if held is None or held.lora_int_id not in in_use]
            if not free:
                return None
            slot = min(free, key=lambda s: (self.adapters[s] is not None, self._last_used[s]))
            self.adapters[slot] = adapter
        self._last_used[slot] = next(self._clock)
        return slot, load

    def reset(self) -> None:
        """The workers hold nothing (they were restarted)."""
        self.adapters = [None] * len(self.adapters)

    def loaded(self) -> list[LoRARequest]:
        return [held for held in self.adapters if held is not None]
