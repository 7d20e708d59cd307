"""Routing by the exact cached prefix.

Each `ModelServer` replica publishes which blocks its prefix cache holds through Serve's routing stats:
the low 32 bits of every cached block's chained hash, sorted (4 bytes a block, `summarize`). The
`PrefixAwareRouter` runs in each caller's deployment handle (the ingress); for a prompt given as token ids
it computes the same chained hashes (`prefix_hashes`, the block manager's) and sends the request to the
replica holding the longest cached prefix, unless that replica's queue is longer than the least loaded
replica's by more than `imbalance_threshold`: then the request goes to the best match among the replicas
within the threshold, so a flood of one prefix still spreads.

Published summaries lag by up to Serve's stats period, so the router also remembers, for `memory_s`, the
blocks of the prompts it sent to each replica: a conversation's next turn finds its replica at once. The
settings are `PrefixRouting`'s (`prefix_routing` in deploy/config.yaml).

When the replica chosen holds a shorter prefix than another one (the holder is busy), the request names the holder
(`KVSource`, in `generate_deltas`' `kv_source`), from which the chosen replica may fetch the blocks it lacks instead of
computing them (`prefix_fetch.py`; `transfer` in the settings). That fetch is a call of its own to the deployment,
`export_prefix`, which this router sends to the replica the call names.

A request with a LoRA adapter hashes its blocks under the adapter (the block manager files them so), and among
replicas holding as long a prefix of it prefers those whose workers hold the adapter in a slot (published as
`adapters`, or sent the adapter lately): a replica that must load it first comes after, under the same imbalance
rule."""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.scheduler.block_manager import prefix_hashes

ROUTED_METHOD = "generate_deltas"  # ModelServer's method taking (prompt, params, request_id, prompt_ids, lora)
# ModelServer's methods routed by their prompt: `generate_deltas`, and a prefill replica's `prefill_export`
# (prompt, params, request_id, first_block, lora)
ROUTED_METHODS = (ROUTED_METHOD, "prefill_export")
EXPORT_METHOD = "export_prefix"  # ModelServer's method that exports K/V, sent to the replica its first argument names
TRANSFER_SETTINGS = (None, True, False, "always")  # `PrefixRouting.transfer`
_MAX_REMEMBERED = 1 << 16  # blocks remembered per replica (a bound for very busy ingresses)
# Serve's first probe deadline (RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S, 0.1 s) doubled twice: a replica computing
# steps on loaded cores answers late, and one left out of the choice makes the choice wrong (a busy holder chosen)
_PROBE_BACKOFF_INDEX = 2


def _low32(hashes: Iterable[int]) -> np.ndarray:
    """The key a block hash is published and looked up under: its low 32 bits."""
    return (np.fromiter(hashes, dtype=np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def summarize(hashes: Iterable[int]) -> bytes:
    """A replica's cached block hashes, compact: their keys (`_low32`), sorted, deduplicated."""
    return np.unique(_low32(hashes)).tobytes()


def cached_mask(summary: bytes, hashes: list[int]) -> np.ndarray:
    """For each of `hashes`, whether `summary` (from `summarize`) holds it. A 32-bit match may be a
    collision; at ~1e5 cached blocks that is one lookup in 40,000, and it costs only a worse choice."""
    keys = np.frombuffer(summary, dtype=np.uint32)  # (num_cached,) sorted
    if not hashes or keys.size == 0:
        return np.zeros(len(hashes), dtype=bool)
    wanted = _low32(hashes)  # (num_blocks,)
    at = np.minimum(np.searchsorted(keys, wanted), keys.size - 1)
    return keys[at] == wanted


def request_adapter(request: PendingRequest | None) -> int | None:
    """The id of the LoRA adapter a routed request runs with (the fifth argument of `ROUTED_METHODS`), or None."""
    if request is None or request.metadata.call_method not in ROUTED_METHODS or len(request.args) < 5:
        return None
    lora = request.args[4]
    return None if lora is None else lora.lora_int_id


def leading(mask: Iterable[bool]) -> int:
    """How many entries hold before the first that does not: a chained hash stands for its whole prefix."""
    count = 0
    for held in mask:
        if not held:
            break
        count += 1
    return count


@dataclass(frozen=True)
class KVSource:
    """The replica that holds the leading `num_blocks` of a request's prompt (as far as the router knows), named to
    the replica the request went to instead. `replica`: its Serve replica id (`ReplicaID.unique_id`)."""

    replica: str
    num_blocks: int


@dataclass(frozen=True)
class PrefixRouting:
    """The prefix-aware router's settings (`prefix_routing` in deploy/config.yaml)."""

    imbalance_threshold: int = 4  # route by prefix unless that queue is this many requests over the shortest
    stats_period_s: float = 1.0  # how often each replica publishes its cached blocks
    memory_s: float = 30.0  # how long the router counts the blocks of what it sent a replica as cached there
    # A replica sent a request whose prefix another holds fetches the blocks from it where that is faster than
    # computing them: None, where the model allows it (one KV-cache group, prefix caching on); True: required, and
    # refused at start where it cannot; "always": required, and whatever the cost (to measure the transfer itself);
    # False: never.
    transfer: bool | str | None = None

    @classmethod
    def parse(cls, setting: bool | dict[str, Any] | None) -> PrefixRouting | None:
        """True / None: on with defaults; False: off (Serve's default router); a dict: on, with these."""
        if setting is False:
            return None
        if setting is None or setting is True:
            return cls()
        if not isinstance(setting, dict):
            raise ValueError(f"prefix_routing={setting!r} must be true, false or a mapping of settings")
        unknown = set(setting) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"prefix_routing has unknown settings {sorted(unknown)}")
        routing = cls(**setting)
        if not isinstance(routing.imbalance_threshold, int) or routing.imbalance_threshold < 0:
            raise ValueError(f"prefix_routing.imbalance_threshold={routing.imbalance_threshold!r} must be an "
                             "integer >= 0")
        if routing.transfer not in TRANSFER_SETTINGS:
            raise ValueError(f"prefix_routing.transfer={routing.transfer!r} must be one of {TRANSFER_SETTINGS}")
        for name in ("stats_period_s", "memory_s"):
            value = getattr(routing, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"prefix_routing.{name}={value!r} must be > 0")
        return routing


class PrefixAwareRouter(RequestRouter):
    """Serve request router for `ModelServer` (see the module's docstring). Calls other than those of
    `ROUTED_METHODS` with token ids go to the less loaded of two random replicas, as Serve's default."""

    def initialize_state(self, block_size: int, imbalance_threshold: int, memory_s: float,
                         transfer: bool = False) -> None:
        """Serve calls this with `request_router_kwargs` (`model_server_options` sets them from `PrefixRouting`).
        `transfer`: name the holder of a longer prefix to the replica chosen instead (`KVSource`)."""
        self.block_size = block_size
        self.imbalance_threshold = imbalance_threshold
        self.memory_s = memory_s
        self.transfer = transfer
        self._remembered: dict[ReplicaID, OrderedDict[int, float]] = {}  # block hash -> when sent
        self._in_flight: dict[ReplicaID, set[str]] = {}  # this handle's requests on each replica
        self._adapters_sent: dict[ReplicaID, dict[int, float]] = {}  # LoRA adapter id -> when sent

    def prompt_hashes(self, request: PendingRequest | None) -> list[int]:
        if request is None or request.metadata.call_method not in ROUTED_METHODS or not request.args:
            return []
        prompt = request.args[0]
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return []  # text: the engine tokenizes it; the ingress sends token ids when this router is on
        return prefix_hashes(prompt, self.block_size, request.args[1].cache_salt, request_adapter(request))

    def holds_adapter(self, replica: RunningReplica, adapter: int | None, now: float) -> bool:
        """Whether `replica`'s workers hold `adapter` (published, or sent there lately by us)."""
        if adapter is None:
            return True
        sent = self._adapters_sent.get(replica.replica_id, {}).get(adapter, now - self.memory_s)
        return adapter in replica.routing_stats.get("adapters", ()) or sent > now - self.memory_s

    def cached_blocks(self, replica: RunningReplica, hashes: list[int], now: float) -> int:
        """Leading blocks of the prompt that `replica` holds: published, or sent there lately by us."""
        published = cached_mask(replica.routing_stats.get("cached_blocks", b""), hashes)
        remembered = self._remembered.get(replica.replica_id, {})
        cutoff = now - self.memory_s
        return leading(bool(p) or remembered.get(h, cutoff) > cutoff for p, h in zip(published, hashes, strict=True))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # one call weighs every replica
            if pending_request.metadata.call_method == EXPORT_METHOD:  # to the replica it names, or none
                return [[r for r in candidate_replicas if r.replica_id.unique_id == pending_request.args[0]]]
        hashes = self.prompt_hashes(pending_request)
        adapter = request_adapter(pending_request)
        if (not hashes and adapter is None) or len(candidate_replicas) == 1:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        queue: dict[ReplicaID, int] = {}
        for replica, length in await self._probe_queue_lens(candidate_replicas, _PROBE_BACKOFF_INDEX):
            if length is not None and length < replica.max_ongoing_requests:
                # a probe can miss the requests this handle sent a moment ago; our own count cannot
                queue[replica.replica_id] = max(length, len(self._in_flight.get(replica.replica_id, ())))
        replicas = [r for r in candidate_replicas if r.replica_id in queue]
        if not replicas:
            return [candidate_replicas]  # none answered: Serve probes again with backoff
        least = min(queue.values())
        now = time.monotonic()
        balanced = [r for r in replicas if queue[r.replica_id] - least <= self.imbalance_threshold]
        ranked = sorted(balanced, key=lambda r: (-self.cached_blocks(r, hashes, now),
                                                 not self.holds_adapter(r, adapter, now), queue[r.replica_id],
                                                 random.random()))
        rest = sorted((r for r in replicas if r not in balanced), key=lambda r: queue[r.replica_id])
        if self.transfer:  # among them all: a holder busy past the probe's deadline still holds its blocks
            self._name_holder(pending_request, ranked[0], candidate_replicas, hashes, now)
        return [[ranked[0]], ranked[1:] + rest]

    def _name_holder(self, request: PendingRequest, chosen: RunningReplica, replicas: list[RunningReplica],
                     hashes: list[int], now: float) -> None:
        """Tell the request (`kv_source`) which replica holds more of its prefix than `chosen`, if one does."""
        held = {r.replica_id: self.cached_blocks(r, hashes, now) for r in replicas}
        holder = max(replicas, key=lambda r: held[r.replica_id])
        if held[holder.replica_id] > held[chosen.replica_id]:
            request.kwargs["kv_source"] = KVSource(holder.replica_id.unique_id, held[holder.replica_id])
        else:
            request.kwargs.pop("kv_source", None)  # a retry's choice may differ

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        adapter = request_adapter(pending_request)
        if adapter is not None:
            self._adapters_sent.setdefault(replica_id, {})[adapter] = time.monotonic()
        hashes = self.prompt_hashes(pending_request)
        if not hashes:
            return
        request_id = pending_request.metadata.internal_request_id
        self._in_flight.setdefault(replica_id, set()).add(request_id)
        # Serve's notice that a request ended (`on_request_completed`) can come before this call: a short request may
        # end while the router waits its turn on a busy event loop. The result's own callback cannot come before (it
        # runs at once for a result already done), so no request stays counted as in flight for good.
        loop = asyncio.get_running_loop()
        result.add_done_callback(lambda _: loop.call_soon_threadsafe(self.on_request_completed, replica_id,
                                                                     request_id))
        remembered = self._remembered.setdefault(replica_id, OrderedDict())
        now = time.monotonic()
        for h in hashes:
            remembered[h] = now
            remembered.move_to_end(h)
        while len(remembered) > _MAX_REMEMBERED:
            remembered.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id, set()).discard(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in (set(self._remembered) | set(self._in_flight) | set(self._adapters_sent)) - set(
                self.curr_replicas):
            self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        self._remembered.pop(replica_id, None)
        self._in_flight.pop(replica_id, None)
        self._adapters_sent.pop(replica_id, None)
