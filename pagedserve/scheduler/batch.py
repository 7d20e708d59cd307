"""Plain data passed from the scheduler to the workers and back. No tensors, no devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.lora.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams


@dataclass
class SampleSpec:
    """Draw `num_samples` tokens from the logits of `row`'s last query token (or verify proposals)."""

    seq_id: int
    row: int
    num_samples: int
    # Seeded requests derive each draw's generator from (seed, sample_index + i,
    # output_len): the draw does not depend on batch composition or preemption.
    sample_index: int
    output_len: int
    params: SamplingParams
    # Penalties: the sequence's token history, sent with its first penalized draw in its slot (and again
    # whenever the sampler's counts of it may be off); the sampler counts each later draw itself.
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # Tokens that may not be drawn yet: EOS and stop_token_ids while fewer than min_tokens are out.
    banned_token_ids: list[int] | None = None
    # Structured outputs: the tokens the grammar allows now, bit t % 32 of int32 word t // 32 (little-endian).
    token_bitmask: bytes | None = None
    # Speculative decoding: tokens proposed to follow the row's last known token, which the row computes as its
    # last len(proposals) query tokens. The sampler then reads the logits of the row's last len(proposals) + 1
    # query tokens, one position per proposal and one past them, and emits 1 to len(proposals) + 1 tokens: the
    # draws the sequence would make one at a time, up to the first that is not the proposal (`Sampler._verify`).
    proposals: list[int] | None = None
    # The bans at each proposal's position past the first (`banned_token_ids` holds the first's), where any apply.
    proposal_bans: list[list[int] | None] | None = None
    # Structured outputs: the grammar's mask at each proposal's position past the first (`token_bitmask` is the first's)
    proposal_bitmasks: list[bytes | None] | None = None
    # The proposals are a draft model's, made on the worker (`workers/draft.py`): `proposals` holds placeholders
    # (-1), as the row's input ids do, and the sampler verifies the draft's tokens with its distributions.
    draft: bool = False

    @property
    def num_positions(self) -> int:
        """The logits this sample reads: its row's last query token's, and each proposal's."""
        return 1 + len(self.proposals or ())

    @property
    def num_tokens(self) -> int:
        """The token slots of its draws: one per sample, or one per position of a speculative row (of which it
        emits a prefix)."""
        return self.num_positions if self.proposals else self.num_samples


@dataclass
class PromptLogprobSpec:
    """Score prompt tokens: the logits of `row`'s query tokens [start, start + len(target_token_ids))
    against the prompt tokens that follow each of them; `k` top alternatives per token."""

    row: int
    start: int
    target_token_ids: list[int]
    k: int


@dataclass
class StepBatch:
    """One forward step. Row i computes query tokens input_ids[cu_seqlens_q[i]:cu_seqlens_q[i+1]],
    the last of which sits at position context_lens[i] - 1 of its sequence, seq_ids[i].

    The workers keep every running sequence's block tables, one per KV-cache group (`kv_groups.py`), in row
    `slots[i]` of a table of their own per group; a step sends only what changed: `table_updates[g]` holds
    group g's (slot, start, block ids), the entries from index `start` on, applied in order before the step
    runs. Entries past a row's context are stale and never read; so are a sliding-window group's entries
    before the window, which the workers' tables may still hold after the scheduler let their blocks go (a
    valid block id either way: a kernel's first tile may read them, masked).

    It is also the scheduler's record of the step: `Scheduler.update` reads which sequences ran and
    what each drew from it.

    A step scheduled before the output of the step ahead of it arrived computes tokens not yet known
    here: `deferred_inputs` holds (index into input_ids, index into the previous step's samples) for
    each, and the worker puts the previous step's draw there (input_ids holds -1 meanwhile). A grammar's
    mask for such a sequence follows its pending token: `late_masks` lists the samples whose
    `token_bitmask` reaches the workers after the launch (`Executor.sample`), so the forward runs while
    the host processes the step before and makes the masks."""

    input_ids: list[int]
    cu_seqlens_q: list[int]  # [num_rows + 1]
    context_lens: list[int]  # [num_rows]: tokens in the KV cache once this step's are written
    slots: list[int]  # [num_rows]: each row's block table in the workers' table
    # [groups][updates]: (slot, start, block ids) of each KV-cache group's tables
    table_updates: list[list[tuple[int, int, list[int]]]] = field(default_factory=lambda: [[]])
    seq_ids: list[int] = field(default_factory=list)  # [num_rows]
    # (src, dst) blocks, copy-on-write and tails, done before anything is written, every source read before any
    # destination (a block a tail was copied from may be a later copy's destination). The groups share one block
    # id space, so a copy moves a block's pages in every layer.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The prefix cache's second tier (`scheduler/offload_tier.py`), before the block copies: first (block, slot,
    # hash), cached blocks the scheduler's allocations evicted from the pool, kept in the tier's slots; then (slot,
    # block, hash), blocks restored from it. The workers check that a slot holds the hash it is restored for.
    kv_saves: list[tuple[int, int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int, int]] = field(default_factory=list)
    # K/V moved between replicas (`scheduler/prefix_transfer.py`), after the second tier's copies: (import id, page,
    # block), staged pages copied into blocks; the imports whose pages the workers drop then; (export id, blocks),
    # blocks read into host memory for another replica (-1 - slot: the second tier's slot).
    kv_imports: list[tuple[int, int, int]] = field(default_factory=list)
    kv_released_imports: list[int] = field(default_factory=list)
    kv_exports: list[tuple[int, list[int]]] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobSpec] = field(default_factory=list)
    deferred_inputs: list[tuple[int, int]] = field(default_factory=list)
    late_masks: list[int] = field(default_factory=list)  # indices into samples
    # [num_rows]: each row's sequence length as transformers sees it when it computes these tokens (all its tokens
    # known, which a prefill chunk's context does not reach yet): what dynamic NTK and LongRoPE rotary embeddings
    # choose their frequencies by. Empty: context_lens.
    seq_lens: list[int] = field(default_factory=list)
    # A draft model's K/V behind the target's by one token (all of a row's last proposals were kept, the last of
    # which no draft pass computed): (row, that token), which the draft computes first (`workers/draft.py`).
    draft_catch_up: list[tuple[int, int]] = field(default_factory=list)
    # LoRA: each row's adapter slot (-1: the base model), empty where every row is the base model's; the adapters
    # the workers load into their slots before the step, in order (`lora/slots.py`).
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class SampledTokens:
    token_ids: list[int]  # [num_samples]
    logprobs: list[float] | None = None  # logprob of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sample: the top-k (id, logprob)
    ranks: list[int] | None = None  # each sampled token's rank in its distribution (1 = the most likely)


@dataclass
class StepOutput:
    samples: list[SampledTokens]  # aligned with StepBatch.samples
    prompt_logprobs: list[SampledTokens] = field(default_factory=list)  # aligned with StepBatch.prompt_logprobs
