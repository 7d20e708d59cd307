"""Request and sequence state. A request with `n` samples owns up to `n` sequences."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None  # the text, when the prompt came as text
    sequences: list[Sequence] = field(default_factory=list)
    # False until the first sample is drawn: then the one sequence forks into `n`.
    forked: bool = False

    @property
    def finished(self) -> bool:
        # A sequence only finishes after the fork (or by abort, which ends all of them).
        return bool(self.sequences) and all(s.finished for s in self.sequences)


class Sequence:
    """One token stream. `num_computed_tokens` catches up with `token_ids` step by step:
    prefill, chunked prefill, recompute after preemption and decode are the same path."""

    def __init__(self, seq_id: int, request: Request, token_ids: list[int], sample_index: int) -> None:
        self.seq_id = seq_id
        self.request = request
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.sample_index = sample_index
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the leading full blocks, chained
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[dict] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
