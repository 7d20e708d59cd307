"""Request and sequence state. A request with `n` samples owns up to `n` sequences."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.lora.lora_request import LoRARequest
from pagedserve.outputs import Logprob, PositionLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.prefix_transfer import PrefixImport
from pagedserve.speculative.ngram import NgramIndex
from pagedserve.speculative.policy import Acceptance


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
    # The output budget: params.max_tokens, or what the context leaves (set on admission) when that is None.
    max_tokens: int | None = None
    # Scored prompt tokens so far, when params.prompt_logprobs asks for them; nothing scores the first, which
    # is there with logprob None (the server echoes its text).
    prompt_logprobs: list[PositionLogprobs] | None = None
    # Whoever asked wants only its finished output (the offline `LLM`): no RequestOutput is built for it before.
    final_output_only: bool = False
    # Why a failed step ended it (a worker lost, an engine error); None otherwise.
    error: str | None = None
    # params.bad_words as the token sequences the output may not complete (`LLMEngine.make_request`).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    arrival: int = 0  # the order the scheduler took it in (set by `Scheduler.add_request`)
    # Prompt tokens the prefix cache held when it was first admitted (None before)
    num_cached_tokens: int | None = None
    admitted_at: float | None = None  # time.monotonic() when it was first scheduled (None before)
    # params.structured_outputs compiled (`LLMEngine.make_request`), so that no step waits for a compile
    grammar: object | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # Its prefix's K/V fetched from another replica, staged on the workers until it is admitted (`prefix_transfer.py`)
    kv_import: PrefixImport | None = None
    # Sent back to the queue once by a worker failure before it produced anything; a second failure ends it (a
    # request whose step kills its workers is not run on and on)
    requeued_after_failure: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.params.max_tokens
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            first = self.prompt_token_ids[0]
            self.prompt_logprobs = [PositionLogprobs(first, Logprob(None, token_id=first))]

    @property
    def bans_by_history(self) -> bool:
        """Whether a draw's banned tokens depend on the tokens before it (a bad word of several tokens)."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt tokens are left to score: their positions must be computed, not cached."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        # A sequence only finishes after the fork (or by abort, which ends all of them).
        return bool(self.sequences) and all(s.finished for s in self.sequences)

    @property
    def num_output_tokens(self) -> int:
        return sum(seq.num_output_tokens for seq in self.sequences)

    def finish_reasons(self) -> list[str]:
        """Each sample's finish reason ("abort" for one not finished)."""
        return [seq.finish_reason or "abort" for seq in self.sequences]


class Sequence:
    """One token stream. `num_computed_tokens` catches up with `token_ids` step by step:
    prefill, chunked prefill, recompute after preemption and decode are the same path.

    A token drawn by a step still in flight is pending: the scheduler counts it (a step scheduled ahead
    computes it, its id taken on the worker from the step before), `token_ids` gains it when the step's
    output arrives. At most one is pending: steps are scheduled at most one ahead."""

    def __init__(self, seq_id: int, request: Request, token_ids: list[int], sample_index: int) -> None:
        self.seq_id = seq_id
        self.request = request
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.sample_index = sample_index
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.pending_sample = 0  # the pending token's index among its step's samples
        # One block table per KV-cache group (`BlockManager` makes as many as the model has on the first
        # allocation); a sliding-window group's holds `NULL_BLOCK` where the window let a block go.
        self.block_tables: list[list[int]] = [[]]
        self.block_hashes: list[int] = []  # hashes of the leading full blocks, chained (the same in every group)
        # LongRoPE: whether its K/V are computed under the long factors (it was longer than the trained context
        # when admitted); its blocks are hashed apart from the short factors' (`chain_root`).
        self.rope_long = False
        # The workers keep each running sequence's block tables in a row of their own (`slot`); a step sends
        # only each group's entries past its first `num_sent_blocks`, which the block manager lowers when it
        # rewrites an entry (copy-on-write) and zeroes when it frees the tables.
        self.slot: int | None = None
        self.num_sent_blocks: list[int] = [0]
        # Penalties: whether the sampler holds this sequence's token counts in its slot (it counts each draw
        # itself once it has the history); cleared whenever they may be off, so the history goes again.
        self.penalty_counts_sent = False
        # Speculative decoding: where each n-gram of its tokens first occurs (made when it first decodes)
        self.ngram_index: NgramIndex | None = None
        self.spec_acceptance: Acceptance | None = None  # how often its proposals were kept lately
        # A draft model's K/V lack its token before the next to compute (`StepBatch.draft_catch_up`)
        self.draft_lag = False
        self.num_new_tokens = 0  # the tokens its last step appended (several where proposals were kept)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.logprobs: list[PositionLogprobs] = []

    @property
    def block_table(self) -> list[int]:
        """The first KV-cache group's block table (the only one of a model without windows)."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

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
                f"computed={self.num_computed_tokens}, pending={self.num_pending_tokens}, status={self.status.value})")
