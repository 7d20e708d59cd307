"""A replica fetching a prompt's prefix from the replica that caches it, when the prefix-aware router sent the
request elsewhere (the holder was busy) and named the holder (`KVSource`). The holder exports the blocks this replica
lacks (`ModelServer.export_prefix`, reached through this replica's own handle to the deployment: the router sends
that call to the replica it names); this replica stages them on its workers and queues the request with them
(`AsyncEngine.import_prefix`). Only where the cost model expects the fetch to beat computing them
(`engine/transfer_cost.py`), and never for longer than computing them would take: a fetch that fails or is too slow
is dropped, and the request computes its prefix as it would have. Disaggregated prefill (`prefill_split.py`) stages a
prefill replica's export with the same functions (`blocks_to_fetch`, `import_export`)."""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve
from ray.serve.handle import DeploymentResponse

from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.transfer_cost import TransferCost
from pagedserve.scheduler.prefix_transfer import PrefixImport
from pagedserve.scheduler.request import Request
from pagedserve.serving.prefix_router import KVSource

log = logging.getLogger(__name__)

_MIN_TIMEOUT_S = 5.0  # the least a fetch is given, whatever the prefill it saves would take


class PrefixFetcher:
    def __init__(self, engine: AsyncEngine, cost: TransferCost, always: bool = False) -> None:
        """`always`: fetch whatever the cost model expects (`PrefixRouting.transfer="always"`)."""
        self.engine = engine
        self.cost = cost
        self.always = always
        self._peers = None  # a handle to this deployment, made on the first fetch

    async def fetch(self, request: Request, source: KVSource) -> PrefixImport | None:
        """The blocks of the request's prompt that `source` holds and this replica does not, staged here; None where
        that is not worth it or fails (then counted, logged, and computed here)."""
        context = serve.get_replica_context()
        if source.replica == context.replica_id.unique_id:
            return None  # the router's first choice was busy and the request came to the holder after all
        held, full = blocks_to_fetch(self.engine, request)
        wanted = min(source.num_blocks, full) - held
        if wanted <= 0 or not (self.always or self.cost.worth(wanted)):
            return None
        start = time.perf_counter()
        prompt, cache_salt = request.prompt_token_ids, request.params.cache_salt
        lora_id = None if request.lora is None else request.lora.lora_int_id
        export = self._handle(context).export_prefix.remote(source.replica, prompt, cache_salt, lora_id, held, wanted)
        kv_import = await import_export(self.engine, request, export,
                                        max(_MIN_TIMEOUT_S, 2 * self.cost.prefill_seconds(wanted)),
                                        f"fetching {wanted} KV blocks from replica {source.replica}")
        if kv_import is not None:
            self.cost.observe_fetch(len(kv_import.hashes), time.perf_counter() - start)
        return kv_import

    def _handle(self, context):
        if self._peers is None:
            self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._peers


def blocks_to_fetch(engine: AsyncEngine, request: Request) -> tuple[int, int]:
    """How many of the request's prompt's full blocks, from the first, this replica holds (pool or second tier), and
    how many full blocks come before its last token (always computed here): those after the held ones could come from
    another replica."""
    llm_engine = engine.llm_engine
    prompt = request.prompt_token_ids
    lora_id = None if request.lora is None else request.lora.lora_int_id
    held = llm_engine.cached_prefix_blocks(prompt, request.params.cache_salt, lora_id)
    return held, (len(prompt) - 1) // llm_engine.config.block_size


async def import_export(engine: AsyncEngine, request: Request, export: DeploymentResponse, timeout_s: float,
                        what: str) -> PrefixImport | None:
    """Another replica's export of the request's prefix (`export`, the call that makes it), staged here within
    `timeout_s`; None where it failed or took too long: logged as `what` failed, counted (`kv_transfer_failures`), and
    the call cancelled (the other replica drops it; done, cancelling does nothing)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await engine.import_prefix(await export, request.prompt_token_ids, request.params.cache_salt,
                                              None if request.lora is None else request.lora.lora_int_id)
    except Exception as e:  # the other replica died or dropped it, the pages were lost, or it took too long
        log.warning("%s failed, computing them here: %r", what, e)
        engine.llm_engine.num_import_failures += 1
        return None
    finally:
        export.cancel()

