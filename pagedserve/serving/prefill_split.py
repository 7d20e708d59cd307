"""Disaggregated prefill: prompts computed on prefill replicas, decoded on the others (`prefill` in
deploy/config.yaml). A decode replica makes the request (tokenized, cut, checked) and asks a prefill replica
(`ModelServer.prefill_export`, through a handle to the prefill deployment) for the full blocks of its prompt that it
does not hold; the prefill replica computes them, as a one-token request whose token is dropped, and exports them
(`AsyncEngine.export_prefix`), and the decode replica stages them on its workers (`AsyncEngine.import_prefix`). The
request then runs on the decode replica as it would have there: its prefix lookup finds the imported blocks, it
computes the prompt's last partial block and samples every token, so its output is the tokens a replica computing
the whole prompt gives.

A prefill that fails (the prefill replica died, its queue is full, the pages were lost) or takes longer than
`timeout_s` is cancelled, logged and counted (`kv_transfer_failures`; a prefill imported counts in
`kv_transfer_imports`), and the decode replica computes the prompt itself."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from ray.serve.handle import DeploymentHandle

from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.prefix_transfer import PrefixExport, PrefixImport
from pagedserve.scheduler.request import Request
from pagedserve.serving.prefix_fetch import blocks_to_fetch, import_export

log = logging.getLogger(__name__)

# The engine settings prefill replicas may set apart from the decode replicas': how they schedule and what memory
# they take. The model, its dtype, the K/V layout and what hashes a block are the decode replicas', or the blocks
# would not be theirs.
PREFILL_ENGINE_SETTINGS = frozenset({
    "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "scheduling_policy",
    "worker_cpus", "gpus_per_worker", "cuda_graphs", "async_scheduling", "kv_offload_memory", "kv_offload_disk",
    "kv_offload_dir"})


@dataclass(frozen=True)
class PrefillSplit:
    """The prefill deployment's settings (`prefill` in deploy/config.yaml)."""

    num_replicas: int | None = None  # prefill replicas (1 unless autoscaling_config is given)
    autoscaling_config: dict[str, Any] | None = None  # Serve's, as for the decode replicas
    ray_actor_options: dict[str, Any] | None = None  # each prefill replica's engine actor (the decode ones' if None)
    timeout_s: float = 60.0  # the longest a decode replica waits for a prefill before computing the prompt itself
    engine: dict[str, Any] = field(default_factory=dict)  # engine settings of PREFILL_ENGINE_SETTINGS

    @classmethod
    def parse(cls, setting: dict[str, Any] | None) -> PrefillSplit | None:
        """None: no split (every replica prefills its own prompts); a mapping of the fields above, the engine
        settings among them at the top level. ValueError naming the setting that is wrong."""
        if setting is None:
            return None
        if not isinstance(setting, dict):
            raise ValueError(f"prefill={setting!r} must be a mapping of settings (num_replicas, timeout_s, ...) "
                             "or null")
        own = {f.name for f in fields(cls)} - {"engine"}
        engine = {k: v for k, v in setting.items() if k not in own}
        unknown = set(engine) - PREFILL_ENGINE_SETTINGS
        if unknown:
            raise ValueError(f"prefill has settings {sorted(unknown)} that prefill replicas cannot set apart from the "
                             f"decode replicas (they may set {sorted(PREFILL_ENGINE_SETTINGS)}, num_replicas, "
                             "autoscaling_config, ray_actor_options and timeout_s)")
        split = cls(**{k: v for k, v in setting.items() if k in own}, engine=engine)
        if not isinstance(split.timeout_s, int | float) or split.timeout_s <= 0:
            raise ValueError(f"prefill.timeout_s={split.timeout_s!r} must be > 0")
        return split


class RemotePrefill:
    """A decode replica's side: its requests' prompts prefilled by the prefill deployment (`prefill` of
    `AsyncEngine.generate`'s `fetch_prefix`)."""

    def __init__(self, engine: AsyncEngine, prefill_servers: DeploymentHandle, timeout_s: float) -> None:
        """`prefill_servers`: the prefill deployment's handle."""
        self.engine = engine
        self.prefill_servers = prefill_servers
        self.timeout_s = timeout_s

    async def prefill(self, request: Request) -> PrefixImport | None:
        """The full blocks of the request's prompt that this replica does not hold, computed on a prefill replica and
        staged here; None where it holds them all, or the prefill failed (then computed here)."""
        held, wanted = blocks_to_fetch(self.engine, request)
        if wanted <= held:
            return None
        # only the blocks wanted: the partial block after them is this replica's to compute
        prompt = request.prompt_token_ids[:wanted * self.engine.llm_engine.config.block_size]
        export = self.prefill_servers.prefill_export.remote(prompt, request.params, request.request_id, held,
                                                            request.lora)
        return await import_export(self.engine, request, export, self.timeout_s,
                                   f"prefilling {wanted - held} blocks of request {request.request_id} on a prefill "
                                   "replica")


async def prefill_export(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str | None,
                         first_block: int, lora: LoRARequest | None) -> PrefixExport:
    """A prefill replica's side: compute `prompt` (a one-token request, its token dropped; blocks this replica
    caches are not computed again) and export its full blocks from `first_block` on. `request_id`, the decode
    replica's, is logged, not used: requests of several decode replicas may share one, so the engine numbers its own."""
    log.debug("prefilling %d tokens of request %s", len(prompt), request_id)
    # a request's priority orders its prefill too, where this replica schedules by priority
    priority = params.priority if engine.llm_engine.config.scheduling_policy == "priority" else 0
    one_token = SamplingParams(max_tokens=1, temperature=0.0, cache_salt=params.cache_salt, priority=priority)
    async for _ in engine.generate(prompt, one_token, None, lora):
        pass
    lora_id = None if lora is None else lora.lora_int_id
    return await engine.export_prefix(prompt, params.cache_salt, lora_id, first_block)
