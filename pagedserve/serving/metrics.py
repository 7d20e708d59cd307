"""Engine metrics as Ray metrics: they appear on every Ray node's metrics export endpoint (Prometheus text) and on
the Ray dashboard's Metrics view. Names are prefixed `pagedserve_` (Ray adds `ray_` in front when exporting). Each
series is labelled with the model, and (Serve's metric classes add them in a replica) with the `replica`, its
`deployment` and its `application`."""

from __future__ import annotations

from typing import Any

from ray.serve.metrics import Counter, Gauge, Histogram

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]


class ServerMetrics:
    def __init__(self, model: str) -> None:
        tags = ("model",)
        self.running = Gauge("pagedserve_requests_running", "Requests with sequences in the running batch.", tags)
        self.waiting = Gauge("pagedserve_requests_waiting", "Requests queued for admission.", tags)
        self.kv_usage = Gauge("pagedserve_kv_cache_usage", "Fraction of KV blocks in use (0..1).", tags)
        self.prefix_queries = Counter("pagedserve_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", tags)
        self.prefix_hits = Counter("pagedserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", tags)
        self.preemptions = Counter("pagedserve_preemptions", "Sequences preempted (recomputed later).", tags)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests.", tags)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Generated tokens.", tags)
        self.finished = Counter("pagedserve_requests_finished", "Finished requests by finish reason.",
                                ("model", "reason"))
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS,
                              tags)
        self.itl = Histogram("pagedserve_inter_token_latency_seconds", "Time between a request's tokens.",
                             _LATENCY_BUCKETS, tags)
        self.queue_time = Histogram("pagedserve_request_queue_time_seconds", "Time from arrival to first being "
                                    "scheduled.", _E2E_BUCKETS, tags)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _E2E_BUCKETS, tags)
        self.step_time = Histogram("pagedserve_step_time_seconds", "Engine step time (schedule, workers, update).",
                                   _LATENCY_BUCKETS, tags)
        # Speculative decoding (vLLM's counts): rows that verified proposals, the tokens proposed, those kept; and
        # since the start, the share kept and the tokens a verifying row emits (its kept proposals and one more)
        self.spec_rows = Counter("pagedserve_spec_decode_num_drafts", "Rows that verified proposed tokens.", tags)
        self.spec_proposed = Counter("pagedserve_spec_decode_num_draft_tokens", "Tokens proposed.", tags)
        self.spec_accepted = Counter("pagedserve_spec_decode_num_accepted_tokens", "Proposed tokens kept.", tags)
        self.spec_rate = Gauge("pagedserve_spec_decode_acceptance_rate", "Proposed tokens kept, as a share of "
                               "those proposed, since the start.", tags)
        self.spec_length = Gauge("pagedserve_spec_decode_mean_accepted_length", "Tokens a verifying row emits on "
                                 "average (its kept proposals and the token after them), since the start.", tags)
        # The prefix cache's second tier: the prompt tokens found there (among prefix_cache_hits), the blocks it
        # kept and restored, and the share of its blocks in use
        self.offload_hits = Counter("pagedserve_kv_offload_hits", "Prompt tokens found in the KV offload tier "
                                    "(counted among the prefix cache's hits).", tags)
        self.offload_saved = Counter("pagedserve_kv_offload_saved_blocks", "KV blocks evicted from the pool that "
                                     "the offload tier kept.", tags)
        self.offload_restored = Counter("pagedserve_kv_offload_restored_blocks", "KV blocks restored from the "
                                        "offload tier instead of recomputed.", tags)
        self.offload_usage = Gauge("pagedserve_kv_offload_usage", "Fraction of the KV offload tier's blocks holding "
                                   "a block (0..1).", tags)
        # K/V moved between replicas: prompt tokens found in blocks fetched from another (among prefix_cache_hits),
        # the fetches staged and those given up (then computed), and the exports this replica read for others
        self.transfer_hits = Counter("pagedserve_kv_transfer_hits", "Prompt tokens found in KV blocks fetched "
                                     "from another replica (counted among the prefix cache's hits).", tags)
        self.transfer_imports = Counter("pagedserve_kv_transfer_imports", "Prefixes fetched from another "
                                        "replica.", tags)
        self.transfer_failures = Counter("pagedserve_kv_transfer_failures", "Fetches from another replica given "
                                         "up (the prefix was computed instead).", tags)
        self.transfer_exports = Counter("pagedserve_kv_transfer_exports", "Prefixes this replica read out for "
                                        "another.", tags)
        for metric in vars(self).values():  # recorded without tags from here on: merging them costs a record
            metric.set_default_tags({"model": model})
        self._last: dict[str, int] = {}

    def on_step(self, seconds: float, stats: dict[str, Any]) -> None:
        self.step_time.observe(seconds)
        self.on_state(stats)

    def on_state(self, stats: dict[str, Any]) -> None:
        """Gauges and cumulative counters from engine stats; also called while idle, so the gauges read
        the current state (0 running once traffic stops), not the last busy step's."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        total = stats["num_total_blocks"]
        self.kv_usage.set((total - stats["num_free_blocks"]) / total if total else 0.0)
        for key, counter in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                             ("num_preemptions", self.preemptions), ("spec_num_rows", self.spec_rows),
                             ("spec_num_proposed_tokens", self.spec_proposed),
                             ("spec_num_accepted_tokens", self.spec_accepted), ("offload_hits", self.offload_hits),
                             ("offload_saved_blocks", self.offload_saved),
                             ("offload_restored_blocks", self.offload_restored),
                             ("kv_transfer_hits", self.transfer_hits), ("kv_transfer_imports", self.transfer_imports),
                             ("kv_transfer_failures", self.transfer_failures),
                             ("kv_transfer_exports", self.transfer_exports)):
            if key not in stats:  # no speculative decoding, no offload tier
                continue
            delta = stats[key] - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            self._last[key] = stats[key]
        if "spec_num_rows" in stats:
            self.spec_rate.set(stats["spec_acceptance_rate"])
            self.spec_length.set(stats["spec_mean_accepted_length"])
        if "offload_total_blocks" in stats:
            self.offload_usage.set(stats["offload_used_blocks"] / stats["offload_total_blocks"])

    def on_tokens(self, count: int, first_token_latencies: list[float], inter_token_latencies: list[float]) -> None:
        # Once per step, not per request: each record costs microseconds, and a step may carry hundreds.
        self.generation_tokens.inc(count)
        for seconds in first_token_latencies:
            self.ttft.observe(seconds)
        for seconds in inter_token_latencies:
            self.itl.observe(seconds)

    def on_finish(self, reasons: list[str], prompt_tokens: int, seconds: float, queued_seconds: float | None) -> None:
        for reason in reasons:
            self.finished.inc(1, {"reason": reason})
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(seconds)
        if queued_seconds is not None:
            self.queue_time.observe(queued_seconds)
