"""A worker's LoRA adapters: its model's projections get `max_loras` slots (`attach_lora`), which take the adapters
the scheduler's steps name (`StepBatch.lora_loads`); an adapter read from disk is kept in host memory, this rank's
shards of it, for the `max_cpu_loras` most recently loaded, so that swapping it back in reads no file."""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedserve.lora.adapter import ATTENTION_TARGETS
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.workers.models.lora_layers import attach_lora, read_model_adapter
from pagedserve.workers.models.parallel import shard_range

AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, projection) -> (A, B)


class AdapterLoader:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.model = model
        self.max_rank = max_rank
        self.projections = attach_lora(model, max_loras, max_rank)  # [(layer, LoRAProjection)]
        self.max_cpu_loras = max_cpu_loras
        self.in_host_memory: OrderedDict[int, AdapterWeights] = OrderedDict()  # by lora_int_id, least recent first

    def load(self, slot: int, adapter: LoRARequest) -> None:
        """Slot `slot` of every projection takes `adapter` (its parts the adapter lacks add nothing)."""
        weights = self._weights(adapter)
        for layer, projection in self.projections:
            projection.load(slot, {name: pair for (i, name), pair in weights.items()
                                   if i == layer and name in projection.parts})

    def _weights(self, adapter: LoRARequest) -> AdapterWeights:
        weights = self.in_host_memory.pop(adapter.lora_int_id, None)
        if weights is None:
            spec = read_model_adapter(adapter.lora_path, self.model.config, self.max_rank)
            weights = {module: self._shard(module, a, b)
                       for module, (a, b) in spec.load(self.model.model.norm.weight.dtype).items()}
        self.in_host_memory[adapter.lora_int_id] = weights
        while len(self.in_host_memory) > self.max_cpu_loras:
            self.in_host_memory.popitem(last=False)
        return weights

    def _shard(self, module: tuple[int, str], a: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapted projection's A [r, in] and B [out, r]: B's rows where the projection's
        output is split (q/k/v, gate/up), A's columns where its input is (o, down)."""
        layer, name = module
        block = "self_attn" if name in ATTENTION_TARGETS else "mlp"  # the checkpoint's name its split follows
        split = shard_range(f"model.layers.{layer}.{block}.{name}.weight", self.model.tp, self.model.config)
        if split is None or self.model.tp.size == 1:
            return a, b
        dim, start, length = split
        if dim == 0:
            return a, b.narrow(0, start, length).contiguous()
        return a.narrow(1, start, length).contiguous(), b
