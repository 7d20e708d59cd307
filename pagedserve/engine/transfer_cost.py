"""Whether fetching a prefix's K/V from another replica beats computing it here.

Fetching n blocks takes about `base + per_block * n`: the source's next step reads them, then Ray moves each rank's
pages to the same rank here. Computing them takes `per_token * n * block_size` on top of the step the request runs
anyway (its last token is computed whatever is cached). Both are measured when the replica starts (`measure`):
prefills of two lengths, and the replica's own blocks exported and staged back through Ray. Every fetch after that
is measured too, so a source whose steps are long (a busy one reads the blocks only at its next step) counts as it
is, and the older measurements fade."""

from __future__ import annotations

import os
import random
import time

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from pagedserve.speculative.policy import StepCost


class TransferCost:
    def __init__(self, block_size: int, prefill_per_token: float) -> None:
        self.block_size = block_size
        self.prefill_per_token = prefill_per_token  # seconds a prompt token's prefill takes
        self.fetches = StepCost()  # a fetch's seconds as base + per_block * blocks

    def observe_fetch(self, num_blocks: int, seconds: float) -> None:
        self.fetches.observe(num_blocks, seconds)

    def fetch_seconds(self, num_blocks: int) -> float:
        base, per_block = self.fetches.fit() or (0.0, 0.0)
        return base + per_block * num_blocks

    def prefill_seconds(self, num_blocks: int) -> float:
        return self.prefill_per_token * num_blocks * self.block_size

    def worth(self, num_blocks: int) -> bool:
        """Whether fetching `num_blocks` is expected to take less time than computing them."""
        return num_blocks > 0 and self.fetch_seconds(num_blocks) < self.prefill_seconds(num_blocks)


def measure(engine: LLMEngine, num_tokens: int = 512) -> TransferCost:
    """Measure both on `engine` before it serves (it must have nothing to run): prompts of random tokens under a
    cache salt of their own (no request shares their blocks), prefilled at one block and at about `num_tokens`, then
    one block and all of the long prompt's exported and imported back."""
    bs = engine.config.block_size
    room = min(engine.scheduler.prompt_room(1), engine.scheduler.max_num_batched_tokens)
    long_blocks = max(2, min(num_tokens, room - 1) // bs)
    salt = f"pagedserve-transfer-probe-{os.getpid()}-{time.monotonic_ns()}"
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(num_blocks: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(num_blocks * bs + 1)]

    def prefill(tokens: list[int]) -> float:
        start = time.perf_counter()
        engine.add_request(tokens, SamplingParams(max_tokens=1, cache_salt=salt))
        _run(engine)
        return time.perf_counter() - start

    prefill(prompt(1))  # the first step of a process pays for what later ones reuse
    short, long = prefill(prompt(1)), prompt(long_blocks)
    cost = TransferCost(bs, max(0.0, (prefill(long) - short) / ((long_blocks - 1) * bs)))
    for num_blocks in (1, long_blocks):
        start = time.perf_counter()
        export_id = engine.export_prefix(long, salt, num_blocks=num_blocks)
        while export_id not in engine.exports_done:
            engine.step()
        export = engine.exports_done.pop(export_id)
        if isinstance(export, Exception):
            raise export
        kv_import = engine.import_prefix(export, long, salt)
        if kv_import is None:
            raise RuntimeError("this replica's own K/V could not be imported back (see the log)")
        engine.drop_import(kv_import)
        cost.observe_fetch(num_blocks, time.perf_counter() - start)
        _run(engine)  # the release
    return cost


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
