"""Turns a `StepBatch` into tensors, runs the model over the paged KV pool and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from pagedserve.kernels.backend import AttentionBackend, AttentionContext
from pagedserve.kernels.cpu.native_forward import native_forward
from pagedserve.kernels.lora_products import LoRAStep
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.workers.adapter_loader import AdapterLoader
from pagedserve.workers.block_tables import BlockTables, table_entries
from pagedserve.workers.cuda_graph import DecodeGraphs
from pagedserve.workers.draft import DraftRunner
from pagedserve.workers.kv_pool import layer_caches, model_kv_groups
from pagedserve.workers.kv_transfer import KVTransfer
from pagedserve.workers.models.llama import CausalLM
from pagedserve.workers.models.parallel import broadcast
from pagedserve.workers.offload_store import OffloadStore
from pagedserve.workers.sampler import Draws, Sampler, token_scores
from pagedserve.workers.tensors import host_tensor, on_device, on_device_packed

log = logging.getLogger(__name__)

_PROMPT_LOGITS_CHUNK = 256  # prompt positions whose [n, vocab] logits are held at once


@dataclass
class StepInputs:
    """A step's tensors on the device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: AttentionContext
    # [P] the query tokens whose logits the samples read: each SampleSpec's row's last `num_positions`
    logit_tokens: torch.Tensor
    # (src [C], dst [C]): blocks copied before the forward (copy-on-write, tails), in every layer
    copies: tuple[torch.Tensor, torch.Tensor]


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; `ModelRunner.collect` reads its result."""

    draws: Draws | None
    prompt_scores: Draws | None  # a group per PromptLogprobSpec
    # A step that waits for its `StepBatch.late_masks` (`ModelRunner.sample`): its batch, logits [S, V] and a draft
    # model's proposals with their distributions.
    waiting: tuple[StepBatch, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: torch.Tensor, backend: AttentionBackend, block_size: int,
                 sampler: Sampler | None, share_draws: bool = False) -> None:
        self.model = model
        self.kv_pool = kv_pool  # [layers_per_group, 2, N, B, Hkv, D], shared by the KV-cache groups
        self.kv_caches = layer_caches(model.config, kv_pool)  # per layer: its [2, N, B, Hkv, D] tensor
        self.num_groups = len(model_kv_groups(model.config))
        self.backend = backend
        self.block_size = block_size
        self.sampler = sampler  # None on tensor-parallel ranks other than 0: they return no tokens
        # Tensor parallelism with async scheduling: every rank fills the next step's deferred inputs, so rank 0
        # broadcasts each step's draws to the others.
        self.share_draws = share_draws
        self.device = kv_pool.device
        self.seq_len_rope = model.model.rope.needs_seq_lens  # dynamic NTK, LongRoPE: frequencies by sequence length
        self.decode_graphs: DecodeGraphs | None = None
        self.last_tokens: torch.Tensor | None = None  # [D] the last step's draws, for the next one's deferred inputs
        self.block_tables = [BlockTables(self.device) for _ in range(self.num_groups)]  # per KV-cache group
        # None: the modules run the layers (always for a model with windows, which the native one leaves them)
        self.native_forward = native_forward(model, kv_pool, backend) if self.num_groups == 1 else None
        self.draft: DraftRunner | None = None  # speculative decoding's draft model (`Worker.init_kv_pool`)
        self.adapters: AdapterLoader | None = None  # the model's LoRA adapter slots, where LoRA is on
        self.offload: OffloadStore | None = None  # the prefix cache's second tier, where one is set
        self.transfer: KVTransfer | None = None  # K/V moved to and from other replicas (`Worker.init_kv_pool`)

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Run decode-only steps through `DecodeGraphs` (capture=False: its static buffers, eagerly)."""
        if self.seq_len_rope:
            log.warning("decode CUDA graphs are off: the rotary embedding (dynamic NTK, LongRoPE) depends on each "
                        "step's lengths")
            return
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.num_groups, self.backend,
                                          self.block_size, max_num_seqs, max_model_len, capture)

    def execute(self, batch: StepBatch, late_masks: list[bytes | None] | None = None) -> StepOutput | None:
        return self.collect(self.launch(batch, late_masks))

    @torch.inference_mode()
    def launch(self, batch: StepBatch, late_masks: list[bytes | None] | None = None) -> LaunchedStep:
        """Queue the step's work on the device without waiting for it, so that the host can go on while it
        runs, and queue the next step behind it. A batch with `late_masks` draws with `late_masks` (the
        masks of those samples) when given, else it stops before drawing until `sample` gives them."""
        if batch.kv_saves or batch.kv_loads:  # the second tier's copies, before anything else writes a block
            self.offload.save(batch.kv_saves)
            self.offload.load(batch.kv_loads)
        if batch.kv_imports or batch.kv_released_imports or batch.kv_exports:  # blocks in, then blocks out
            self.transfer.copy(batch.kv_imports, batch.kv_released_imports, batch.kv_exports)
        for slot, adapter in batch.lora_loads:  # before the step that first uses them (queued after the one before)
            self.adapters.load(slot, adapter)
        if not batch.num_rows:  # a step that carries transfers alone
            return LaunchedStep(None, None)
        inputs = self.prepare(batch)
        if batch.block_copies:
            src, dst = inputs.copies
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]  # every source gathered before any write
            if self.draft is not None:
                self.draft.kv_pool[:, :, dst] = self.draft.kv_pool[:, :, src]
        drafts = self._drafts(batch, inputs.input_ids)
        ctx = inputs.ctx
        if self.decode_graphs is not None and self.decode_graphs.can_run(ctx):
            hidden = self.decode_graphs.run(inputs.input_ids, inputs.positions, ctx)  # [T, H]
        elif self.native_forward is not None and ctx.lora is None:  # the native decoder adds no adapters
            hidden = self.native_forward(inputs.input_ids, inputs.positions, ctx)  # [T, H]
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, ctx)  # [T, H]
        prompt_scores = self._score_prompts(hidden, batch)
        if prompt_scores is not None:
            prompt_scores.to_host()
        self.last_tokens = None
        if not batch.samples:
            return LaunchedStep(None, prompt_scores)
        logits = self.model.compute_logits(hidden[inputs.logit_tokens])  # [P, V] fp32; a collective under TP
        if self.sampler is None:
            if self.share_draws:
                self.last_tokens = self._shared_draws(
                    torch.empty(sum(s.num_tokens for s in batch.samples), dtype=torch.long, device=self.device))
            return LaunchedStep(None, prompt_scores)
        if batch.late_masks and late_masks is None:
            return LaunchedStep(None, prompt_scores, waiting=(batch, logits, drafts))
        return LaunchedStep(self._draw(batch, logits, late_masks, drafts), prompt_scores)

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, late_masks: list[bytes | None]) -> None:
        """Queue the draws of a launched step that waits for its masks (`StepBatch.late_masks`)."""
        if step.waiting is None:
            raise RuntimeError("the step was given grammar masks but does not wait for any")
        (batch, logits, drafts), step.waiting = step.waiting, None
        step.draws = self._draw(batch, logits, late_masks, drafts)

    def _drafts(self, batch: StepBatch, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The draft model's proposals for the batch's `draft` samples and their distributions (None without
        any, and on tensor-parallel ranks other than 0), written into `input_ids` [T] at the proposals' slots of
        their rows: the draft runs first. Under tensor parallelism the draft runs whole on rank 0 alone, which
        broadcasts its proposals: every rank computes the same tokens."""
        drafted = [s for s in batch.samples if s.draft]
        tokens = probs = None
        if self.draft is not None:
            tokens, probs = self.draft.propose(batch, input_ids, self.block_tables[0])  # its K/V kept up every step
        if not drafted:
            return None
        if self.model.tp.size > 1:
            if tokens is None:  # [P]: rank 0's proposals, in order
                tokens = torch.empty(sum(len(s.proposals) for s in drafted), dtype=torch.long, device=self.device)
            broadcast(tokens, self.model.tp, src=0)
        cu = batch.cu_seqlens_q
        slots = [cu[s.row + 1] - len(s.proposals) + j for s in drafted for j in range(len(s.proposals))]
        input_ids[on_device(self.device, slots)] = tokens
        return None if probs is None else (tokens, probs)

    def _draw(self, batch: StepBatch, logits: torch.Tensor, late_masks: list[bytes | None] | None,
              drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> Draws:
        specs = batch.samples
        if late_masks is not None:
            specs = list(specs)
            for i, mask in zip(batch.late_masks, late_masks, strict=True):
                specs[i] = replace(specs[i], token_bitmask=mask)
        draws = self.sampler.draw(logits, specs, [batch.slots[s.row] for s in specs], drafts)
        self.last_tokens = self._shared_draws(draws.tokens) if self.share_draws else draws.tokens
        draws.to_host()
        return draws

    def _shared_draws(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tokens` [D] on every rank (in place); queued behind the step on NCCL."""
        return broadcast(tokens, self.model.tp, src=0)

    def collect(self, step: LaunchedStep) -> StepOutput | None:
        """Wait for a launched step; its draws (None on tensor-parallel ranks other than 0)."""
        if self.sampler is None:
            return None
        return StepOutput(samples=step.draws.outputs() if step.draws is not None else [],
                          prompt_logprobs=step.prompt_scores.outputs() if step.prompt_scores is not None else [])

    def _score_prompts(self, hidden: torch.Tensor, batch: StepBatch) -> Draws | None:
        """Logprobs of the prompt tokens that the batch's `PromptLogprobSpec`s name, on the device, a bounded
        slice of logits at a time. None where nothing is scored (or on ranks other than 0)."""
        specs = batch.prompt_logprobs
        if not specs:
            return None
        width = max(spec.k for spec in specs)  # one width of top alternatives for all; each group cuts its own
        parts = []  # per slice: (targets [n], logprobs [n], top values [n, width], top ids [n, width])
        for spec in specs:
            first = batch.cu_seqlens_q[spec.row] + spec.start
            count = len(spec.target_token_ids)
            for c in range(0, count, _PROMPT_LOGITS_CHUNK):
                n = min(_PROMPT_LOGITS_CHUNK, count - c)
                logits = self.model.compute_logits(hidden[first + c:first + c + n])  # [n, V]; a collective under TP
                if self.sampler is None:
                    continue
                targets = on_device(self.device, spec.target_token_ids[c:c + n])
                parts.append((targets, *token_scores(torch.log_softmax(logits, dim=-1), targets, width)))
        if self.sampler is None:
            return None
        tokens, logprobs, top_values, top_ids = (None if p[0] is None else torch.cat(p)
                                                 for p in zip(*parts, strict=True))
        return Draws([(len(spec.target_token_ids), spec.k) for spec in specs], tokens, logprobs, top_ids, top_values)

    def _lora_step(self, batch: StepBatch) -> LoRAStep:
        """The step's tokens grouped by their rows' adapter slots (the base model's rows in none), or each token's
        slot where the backend has its own kernel."""
        cu = batch.cu_seqlens_q
        kernel = self.backend.lora_add
        if kernel is not None:
            token_slots = [slot for row, slot in enumerate(batch.lora_slots) for _ in range(cu[row], cu[row + 1])]
            return LoRAStep(token_slots=on_device(self.device, token_slots, torch.int32), kernel=kernel)  # [T]
        tokens: dict[int, list[int]] = {}
        for row, slot in enumerate(batch.lora_slots):
            if slot >= 0:
                tokens.setdefault(slot, []).extend(range(cu[row], cu[row + 1]))
        if len(tokens) == 1 and len(next(iter(tokens.values()))) == batch.num_tokens:
            return LoRAStep(((next(iter(tokens)), None),))  # one adapter's rows alone: no gather
        indices = on_device(self.device, [i for ids in tokens.values() for i in ids])  # [adapter tokens]
        return LoRAStep(tuple(zip(tokens, indices.split([len(ids) for ids in tokens.values()]), strict=True)))

    def prepare(self, batch: StepBatch) -> StepInputs:
        """The step's tensors on the device, sent in one copy of what the batch brings (the block tables stay
        on the device); positions and slot mapping are derived, vectorised, not sent per token."""
        num_rows = batch.num_rows
        cu = host_tensor(batch.cu_seqlens_q)  # [R + 1]
        q_lens = cu[1:] - cu[:-1]
        context_lens = host_tensor(batch.context_lens)  # [R]
        row_of_token = torch.repeat_interleave(torch.arange(num_rows), q_lens)  # [T]
        offset_in_row = torch.arange(batch.num_tokens) - cu[:-1][row_of_token]
        positions = (context_lens - q_lens)[row_of_token] + offset_in_row  # [T]
        max_query_len = int(q_lens.max())
        deferred_index = [i for i, _ in batch.deferred_inputs]
        deferred_source = [s for _, s in batch.deferred_inputs]
        seq_lens = (batch.seq_lens or batch.context_lens) if self.seq_len_rope else []  # [R] or none
        # Per KV-cache group: its table entries (slots, columns, ids), three lists each.
        num_groups = self.num_groups
        if len(batch.table_updates) != num_groups:
            raise ValueError(f"the step's table_updates hold {len(batch.table_updates)} KV-cache groups, the model "
                             f"{num_groups}")
        entries = [table_entries(updates) for updates in batch.table_updates]
        group_lists = [lst for e_slots, e_cols, e_ids, _ in entries for lst in (e_slots, e_cols, e_ids)]
        cu_list = batch.cu_seqlens_q
        logit_tokens = [cu_list[s.row + 1] - s.num_positions + j for s in batch.samples for j in range(s.num_positions)]
        (positions, row_of_token, cu, context_lens, input_ids, slots, deferred_index, deferred_source, logit_tokens,
         seq_lens, copy_src, copy_dst, *group_tensors) = on_device_packed(self.device, [
            positions, row_of_token, cu, context_lens, batch.input_ids, batch.slots, deferred_index, deferred_source,
            logit_tokens, seq_lens, [s for s, _ in batch.block_copies],
            [d for _, d in batch.block_copies], *group_lists])
        # From here on every tensor is the device's.
        bs = self.block_size
        max_context_len = max(batch.context_lens)
        shape = (max(batch.slots) + 1, -(-max_context_len // bs))
        tables = []
        for g in range(num_groups):
            e_slots, e_cols, e_ids = group_tensors[3 * g:3 * g + 3]
            self.block_tables[g].write(entries[g][3], e_slots, e_cols, e_ids)
            block_tables = self.block_tables[g].rows(slots, shape)  # [R, blocks]
            slot_mapping = block_tables[row_of_token, positions // bs] * bs + positions % bs  # [T]
            tables.append((slot_mapping, block_tables))
        ctx = AttentionContext(
            backend=self.backend,
            slot_mapping=tables[0][0],
            cu_seqlens_q=cu,
            context_lens=context_lens,
            block_tables=tables[0][1],
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            token_seq_lens=seq_lens[row_of_token] if self.seq_len_rope else None,
            more_tables=tuple(tables[1:]),
            lora=self._lora_step(batch) if batch.lora_slots else None,
        )
        if batch.deferred_inputs:
            if self.last_tokens is None:
                raise RuntimeError("the step has deferred inputs but the step before it drew no tokens")
            input_ids[deferred_index] = self.last_tokens[deferred_source]
        return StepInputs(input_ids, positions, ctx, logit_tokens, (copy_src, copy_dst))
