"""Continuous batching: each step, running sequences first, then waiting ones fill the token budget.

Two policies order the queues. "fcfs": requests run in the order they came, and a sequence preempted for
room is the one admitted last. "priority": by each request's `priority` (lower first, then the order they
came): the running and waiting sequences are kept in that order, room is made by preempting the least
urgent, and a waiting request more urgent than a running one preempts it to be admitted."""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable

from pagedserve.lora.lora_request import LoRARequest
from pagedserve.lora.slots import AdapterSlots
from pagedserve.outputs import Logprob, PositionLogprobs
from pagedserve.scheduler.batch import PromptLogprobSpec, SampledTokens, SampleSpec, StepBatch, StepOutput
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.prefix_transfer import Transfers
from pagedserve.scheduler.request import Request, Sequence, SequenceStatus
from pagedserve.speculative import policy as spec_policy
from pagedserve.speculative.ngram import NgramIndex
from pagedserve.speculative.speculative_config import SpeculativeConfig


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        long_rope_after: int | None = None,
        speculative: SpeculativeConfig | None = None,
        adapter_slots: AdapterSlots | None = None,
    ) -> None:
        """`long_rope_after`: a LongRoPE model's original_max_position_embeddings (see `_rope_switch`).
        `speculative`: propose tokens for decoding sequences, which a step verifies (`_propose`).
        `adapter_slots`: the workers' LoRA adapter slots (None: requests run the base model alone)."""
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy={policy!r} must be one of {POLICIES}")
        for name, value in [("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)]:
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.by_priority = policy == "priority"
        self.long_rope_after = long_rope_after
        self.speculative = speculative
        self.adapter_slots = adapter_slots
        # (slot, adapter) loads the next step sends the workers: a slot taken for a sequence not yet scheduled
        self._adapter_loads: list[tuple[int, LoRARequest]] = []
        self.transfers = Transfers()  # K/V moved to and from other replicas (`prefix_transfer.py`)
        # Speculative decoding with a grammar: the prefix of a constrained sequence's proposals its grammar accepts
        # (`GrammarManager.valid_proposals`); None: such sequences get no proposals
        self.grammar_proposals: Callable[[Sequence, list[int]], list[int]] | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self.num_preemptions = 0
        # Speculative decoding: rows that verified proposals, the tokens proposed and those kept
        self.num_spec_rows = 0
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        # What verifying proposals costs and how often they are kept: how many are worth a step (`policy.py`)
        self.step_cost = spec_policy.StepCost()
        self.spec_acceptance = spec_policy.Acceptance(spec_policy.ENGINE_DECAY)  # faded a step (`schedule`), not a row
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        # Rows of the workers' block table: a sequence holds one while it holds blocks. The lowest free one
        # is reused first, so the table stays as small as the most sequences that ever ran at once.
        self._free_slots: list[int] = []
        self._num_slots = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError if it can never run."""
        self.check_admissible(request)
        seq = Sequence(next(self._seq_ids), request, list(request.prompt_token_ids), sample_index=0)
        request.sequences.append(seq)
        request.arrival = next(self._arrivals)
        self.requests[request.request_id] = request
        self.seqs[seq.seq_id] = seq
        self._enqueue(self.waiting, seq)

    def prompt_room(self, max_tokens: int | None) -> int:
        """How many prompt tokens leave room for `max_tokens` (at least one token when None) in the longest
        context a sequence can have: the model's, or the pool's where one sequence cannot fill the model's."""
        bm = self.block_manager
        return min(self.max_model_len, bm.max_seq_len(self.max_num_batched_tokens)) - (max_tokens or 1)

    def check_admissible(self, request: Request) -> None:
        """Raise ValueError naming the field if the request can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        if request.params.priority != 0 and not self.by_priority:
            raise ValueError(f"priority={request.params.priority} needs scheduling_policy='priority' (this engine "
                             "runs requests first come, first served)")
        if request.params.n > self.max_num_seqs:
            raise ValueError(f"n={request.params.n} samples are more sequences than max_num_seqs="
                             f"{self.max_num_seqs} runs at once")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt > self.max_model_len:
            raise ValueError(f"prompt has {num_prompt} tokens, more than max_model_len={self.max_model_len}")
        bm = self.block_manager
        if request.params.max_tokens is None:
            # Until the context is full: the model's, or the pool's if one sequence cannot fill the model's.
            context = min(self.max_model_len, bm.max_seq_len(self.max_num_batched_tokens))
            request.max_tokens = context - num_prompt
            if request.max_tokens < 1:
                raise ValueError(f"prompt has {num_prompt} tokens: no room is left for output in a context "
                                 f"of {context}")
        total = num_prompt + request.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"max_tokens={request.max_tokens} with a {num_prompt}-token prompt needs {total} "
                f"positions, more than max_model_len={self.max_model_len}")
        # One sequence must fit the pool on its own (all groups' blocks); preemption makes room for it then.
        needed = bm.blocks_needed_alone(total, self.max_num_batched_tokens)
        if needed > bm.num_total_blocks:
            raise ValueError(
                f"max_tokens={request.max_tokens} with a {num_prompt}-token prompt needs {needed} KV "
                f"blocks, more than the pool's {bm.num_total_blocks}: the request can never fit")

    def abort(self, request_id: str) -> Request | None:
        """Stop a request now and free its blocks. Unknown ids are ignored (it may have just ended)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.finished:
                self.finish(seq, "abort")
        return request

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release_import(seq.request)
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            return
        self._free_blocks(seq)
        del self.seqs[seq.seq_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.request.finished:
            del self.requests[seq.request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        """Whether a step is due: a sequence to run, or a transfer to carry (which a step without rows does)."""
        return self.has_unfinished() or self.transfers.has_copies

    def _release_import(self, request: Request) -> None:
        """The request's staged import is used (it was admitted) or never will be: the next step releases it."""
        if request.kv_import is not None:
            self.transfers.release(request.kv_import.import_id)
            request.kv_import = None

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> StepBatch | None:
        """Pick this step's rows and blocks, and count them computed. None when there is nothing to run.

        May run while the previous step is in flight (see `can_schedule_ahead`): its draws are then
        pending tokens, computed by this step from ids the worker fills in."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        self.spec_acceptance.fade()
        scheduled: list[tuple[Sequence, int, list[int]]] = []  # (sequence, tokens computed, proposals)
        copies: list[tuple[int, int]] = []  # (src, dst) blocks, for the workers to copy first
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self.max_num_seqs:
            seq = self.running[i]
            if seq.num_pending_tokens and self._ends_by_length(seq, seq.num_tokens_with_pending):
                i += 1  # its pending token is its last: computing that one would be wasted
                continue
            if self._rope_switch(seq):
                self.running.pop(i)
                self._preempt(seq)  # recomputed whole under the long factors when admitted again
                continue
            num_new = min(seq.num_tokens_with_pending - seq.num_computed_tokens, budget)
            proposals = self._propose(seq, budget)
            # The proposals' slots only where there is room for them: speculation never preempts
            seq_copies = bm.allocate_slots(seq, num_new + len(proposals)) if proposals else None
            if seq_copies is not None:
                num_new += len(proposals)
            else:
                proposals = []
            while seq_copies is None and (seq_copies := bm.allocate_slots(seq, num_new)) is None:
                # Out of blocks: recompute the newest request later (never deadlocks, since
                # admission guarantees a lone sequence fits).
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            if seq_copies is None:
                break
            copies += seq_copies
            scheduled.append((seq, num_new, proposals))
            budget -= num_new
            i += 1

        # A request forks into its n samples after its first draw: it is admitted with room for all of them,
        # so that the running sequences, and the block-table slots and penalty counts they hold on the
        # workers (sized for max_num_seqs by the profiled step), never outnumber max_num_seqs.
        num_seqs = sum(_seqs_to_come(s) for s in self.running) if self.waiting else 0
        adapters_in_use: set[int] | None = None  # the adapters of running sequences, when first needed
        skipped: list[Sequence] = []  # sequences whose adapter has no slot this step: the others go on
        while self.waiting and not preempted and budget > 0:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while its last token was in flight: it waits for that token
            lora = seq.request.lora
            if lora is not None:
                if adapters_in_use is None:
                    adapters_in_use = {s.request.lora.lora_int_id for s in self.running if s.request.lora}
                if not self._take_adapter_slot(lora, adapters_in_use):
                    skipped.append(self.waiting.popleft())
                    continue
            seq_copies = None
            if len(scheduled) < self.max_num_seqs and num_seqs + _seqs_to_come(seq) <= self.max_num_seqs:
                seq.rope_long = seq.rope_long or self._rope_switch(seq)  # before its prefix is looked up
                cached = None if seq.request.needs_prompt_logprobs else bm.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - (cached.num_tokens if cached else 0), budget)
                seq_copies = bm.allocate_slots(seq, num_new, cached)
            if seq_copies is None:
                # No room: under "priority", the least urgent running sequence gives way to a more urgent one.
                if not (self.by_priority and self.running
                        and self.running[-1].request.params.priority > seq.request.params.priority):
                    break
                victim = self.running.pop()
                num_seqs -= _seqs_to_come(victim)
                for j, (s, n, _) in enumerate(scheduled):
                    if s is victim:  # it had its rows of this step: they go too
                        del scheduled[j]
                        budget += n
                        break
                victim_blocks = set().union(*victim.block_tables)
                kept = [c for c in copies if c[1] not in victim_blocks]
                # a copy-on-write copy dropped with it: its tail block was never written
                self._preempt(victim, tail_written=len(kept) == len(copies))
                copies = kept
                continue
            self.waiting.popleft()
            self._release_import(seq.request)  # after this step's copies from it
            if seq.request.num_cached_tokens is None:  # its first admission: what the prefix cache held
                seq.request.num_cached_tokens = cached.num_tokens if cached else 0
                seq.request.admitted_at = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self._enqueue(self.running, seq)
            num_seqs += _seqs_to_come(seq)
            copies += seq_copies
            scheduled.append((seq, num_new, []))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        if not scheduled and not self.transfers.has_copies:
            return None
        return self._make_batch(scheduled, copies)

    def _take_adapter_slot(self, lora: LoRARequest, in_use: set[int]) -> bool:
        """Whether a slot holds (or now takes) the adapter: it then counts as in use. A slot newly taken is loaded
        by the next step the workers get."""
        taken = self.adapter_slots.acquire(lora, in_use)
        if taken is None:
            return False
        slot, load = taken
        if load:
            self._adapter_loads.append((slot, lora))
        in_use.add(lora.lora_int_id)
        return True

    def reset_worker_state(self) -> None:
        """The workers hold none of what the scheduler records of them (new workers, or a failed step that may
        have written some of it): the prefix cache and the adapters in their slots are forgotten."""
        self.block_manager.reset()
        self.transfers.reset()
        for request in self.requests.values():
            request.kv_import = None  # its pages are released again, or went with the workers
        if self.adapter_slots is not None:
            self.adapter_slots.reset()
        self._adapter_loads = []

    def _make_batch(self, scheduled: list[tuple[Sequence, int, list[int]]],
                    copies: list[tuple[int, int]]) -> StepBatch:
        batch = StepBatch(input_ids=[], cu_seqlens_q=[0], context_lens=[], slots=[], block_copies=copies,
                          table_updates=[[] for _ in range(self.block_manager.num_groups)])
        batch.kv_saves, batch.kv_loads = self.block_manager.take_offload_copies()
        batch.kv_imports = self.block_manager.take_imports()
        batch.kv_released_imports = self.transfers.take_releases()
        batch.kv_exports = self.transfers.take_exports(self.block_manager.export_blocks)
        if self.adapter_slots is not None:
            batch.lora_loads, self._adapter_loads = self._adapter_loads, []
            if any(seq.request.lora is not None for seq, _, _ in scheduled):
                batch.lora_slots = [-1 if seq.request.lora is None else self.adapter_slots.slot_of(seq.request.lora)
                                    for seq, _, _ in scheduled]
        for row, (seq, num_new, proposals) in enumerate(scheduled):
            start = seq.num_computed_tokens
            end = start + num_new
            num_known = num_new - len(proposals)
            known = seq.token_ids[start:start + num_known]
            batch.input_ids.extend(known)
            deferred = len(known) < num_known
            if deferred:  # the pending token, drawn by the step in flight
                if num_known - len(known) > 1:
                    raise RuntimeError(f"sequence {seq.seq_id} has {num_known - len(known)} pending tokens: "
                                       "steps may be scheduled only one ahead")
                batch.deferred_inputs.append((len(batch.input_ids), seq.pending_sample))
                batch.input_ids.append(-1)
            batch.input_ids.extend(proposals)
            if seq.draft_lag:  # the draft computes the token it has not, before this row's
                batch.draft_catch_up.append((row, seq.token_ids[start - 1]))
                seq.draft_lag = False
            seq.num_computed_tokens = end
            batch.cu_seqlens_q.append(batch.cu_seqlens_q[-1] + num_new)
            batch.context_lens.append(end)
            batch.seq_lens.append(seq.num_tokens_with_pending)
            self._send_block_table(seq, batch)
            batch.seq_ids.append(seq.seq_id)
            request = seq.request
            if request.needs_prompt_logprobs:
                # Position j's logits score prompt token j + 1: those not yet scored, within this row.
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    batch.prompt_logprobs.append(PromptLogprobSpec(
                        row=row, start=first - start, target_token_ids=request.prompt_token_ids[first + 1:last + 1],
                        k=request.params.prompt_logprobs))
            if end - len(proposals) == seq.num_tokens_with_pending:  # caught up: the row's last logits give the next
                num_output = end - len(proposals) - seq.num_prompt_tokens  # out before this draw
                params = request.params
                send_history = params.needs_penalties and not seq.penalty_counts_sent
                if send_history and deferred:
                    # Counts are dropped only where no token is in flight when the sequence next draws (a new
                    # or preempted sequence, a fork, a failed step): a history is always whole.
                    raise RuntimeError(f"sequence {seq.seq_id}'s penalty history would go without its pending "
                                       "last token")
                seq.penalty_counts_sent = params.needs_penalties
                seq.pending_sample = len(batch.samples)
                seq.num_pending_tokens += 1
                batch.samples.append(SampleSpec(
                    seq_id=seq.seq_id,
                    row=row,
                    num_samples=1 if request.forked else params.n,
                    sample_index=seq.sample_index,
                    output_len=num_output,
                    params=params,
                    prompt_token_ids=request.prompt_token_ids if send_history else None,
                    output_token_ids=seq.output_token_ids if send_history else None,
                    banned_token_ids=self._banned_tokens(seq, num_output),
                    proposals=proposals or None,
                    proposal_bans=self._proposal_bans(seq, num_output, proposals),
                    draft=bool(proposals) and self.speculative.method == "draft_model",
                ))
        return batch

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """Tokens proposed to follow a decoding sequence's last token, for this step to verify (none where it
        is not decoding or its last token not known here yet), a grammar's sequence the proposals its grammar
        accepts. At most as many as its length limits and the step's token budget leave room for after the token
        verification adds."""
        config = self.speculative
        constrained = seq.request.params.structured_outputs is not None
        if (config is None or seq.num_pending_tokens or seq.num_computed_tokens != seq.num_tokens - 1
                or (constrained and self.grammar_proposals is None)):
            return []
        k = min(config.num_speculative_tokens, budget - 1, self.max_model_len - seq.num_tokens - 1,
                seq.request.max_tokens - seq.num_output_tokens - 1)
        if config.method == "draft_model":
            # The draft's tokens are made on the worker: slots for them here. Not for what needs the proposals on
            # the host: a grammar's check, penalties' counts, the bans of a bad word of several tokens.
            request = seq.request
            if constrained or request.params.needs_penalties or request.bans_by_history:
                return []
            proposals = [DRAFTED] * max(k, 0)
        else:
            if seq.ngram_index is None:
                seq.ngram_index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            proposals = seq.ngram_index.propose(seq.token_ids, k)
        if proposals:
            if seq.spec_acceptance is None:
                seq.spec_acceptance = spec_policy.Acceptance(spec_policy.SEQUENCE_DECAY)
            acceptance = spec_policy.sequence_acceptance(seq.spec_acceptance, self.spec_acceptance)
            worth = spec_policy.worth_verifying(len(proposals), acceptance, self.step_cost.fit(), len(self.running))
            proposals = proposals[:worth]
        return self.grammar_proposals(seq, proposals) if constrained and proposals else proposals

    def _proposal_bans(self, seq: Sequence, num_output: int, proposals: list[int]) -> list[list[int] | None] | None:
        """The bans at each proposal's position past the first: as if the proposals before it were output."""
        bans = [self._banned_tokens(seq, num_output + j, proposals[:j]) for j in range(1, len(proposals) + 1)]
        return bans if any(bans) else None

    def _rope_switch(self, seq: Sequence) -> bool:
        """Whether LongRoPE's long factors apply to the sequence, and its K/V are not computed under them. As
        transformers does, a sequence longer than original_max_position_embeddings uses the long factors for all
        its tokens (a prompt that long from its first chunk on); one that grows past it is recomputed whole."""
        return (self.long_rope_after is not None and not seq.rope_long
                and seq.num_tokens_with_pending > self.long_rope_after)

    def can_schedule_ahead(self, batch: StepBatch, late_masks: bool) -> bool:
        """Whether the next step may be scheduled before `batch`'s output arrives: not when a draw of it
        must be known on the host first: a request forking into its n samples, a grammar's next mask
        unless the executor takes masks after a launch (`late_masks`, see `StepBatch.late_masks`), or the
        next bans of a bad word of several tokens.
        Penalties count the draw on the worker. With speculative decoding, not when a sequence might have
        tokens proposed next: the proposals follow its last token, which must be known here."""
        return all(s.num_samples == 1 and (late_masks or s.params.structured_outputs is None)
                   and not (s.params.bad_words and self._bans_by_history(s.seq_id))
                   and not self._may_speculate(s) for s in batch.samples)

    def _may_speculate(self, spec: SampleSpec) -> bool:
        return self.speculative is not None and (spec.params.structured_outputs is None
                                                 or self.grammar_proposals is not None)

    def _bans_by_history(self, seq_id: int) -> bool:
        seq = self.seqs.get(seq_id)
        return seq is not None and seq.request.bans_by_history

    def discard_pending(self) -> None:
        """Forget the draws of steps that will never report (their step failed): those tokens are drawn
        again when the sequences run next."""
        for seq in self.seqs.values():
            seq.num_pending_tokens = 0
            seq.penalty_counts_sent = False  # the failed step may or may not have counted its draws

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence is at its length limit (max_tokens or max_model_len) with `num_tokens` tokens."""
        return num_tokens - seq.num_prompt_tokens >= seq.request.max_tokens or num_tokens >= self.max_model_len

    @staticmethod
    def _banned_tokens(seq: Sequence, num_output: int, proposed: list[int] | None = None) -> list[int] | None:
        """What this draw may not be, `num_output` tokens being out before it: a bad word's last token
        where the output ends with the rest of it, and the tokens that end the output before min_tokens.
        `proposed`: tokens that follow the sequence's own before this draw (proposals ahead of it)."""
        request = seq.request
        if num_output >= request.params.min_tokens and not request.bad_words_token_ids:
            return None  # most draws: nothing to ban
        params = request.params
        banned: set[int] = set()
        if request.bad_words_token_ids:
            # The whole output: no step is scheduled ahead of a draw whose bans read it (`can_schedule_ahead`).
            tokens = seq.token_ids + proposed if proposed else seq.token_ids
            num_out = len(tokens) - seq.num_prompt_tokens
            banned = {ids[-1] for ids in request.bad_words_token_ids
                      if len(ids) - 1 <= num_out and tokens[len(tokens) - len(ids) + 1:] == ids[:-1]}
        # A grammar says itself when the output may end; banning its ending could leave nothing to draw.
        if num_output < params.min_tokens and params.structured_outputs is None:
            ending = {*(() if params.ignore_eos else request.eos_token_ids), *params.stop_token_ids}
            if params.allowed_token_ids is None or not (banned | ending).issuperset(params.allowed_token_ids):
                banned |= ending  # unless min_tokens would hold back every allowed token
        return sorted(banned) or None

    def update(self, batch: StepBatch, output: StepOutput) -> list[Sequence]:
        """Apply a finished step: file its full blocks in the prefix cache, append its draws, end the
        sequences that finished.

        Returns the sequences that received a token (children of a fork included).
        """
        bm = self.block_manager
        self.transfers.confirm(batch.kv_released_imports)
        by_id: dict[int, Sequence] = {}
        for seq_id in batch.seq_ids:
            seq = self.seqs.get(seq_id)  # gone if it finished or was aborted meanwhile
            if seq is None:
                continue
            if seq.status == SequenceStatus.RUNNING:  # not preempted by a step scheduled ahead
                bm.cache_full_blocks(seq)
            by_id[seq_id] = seq
        for spec, scored in zip(batch.prompt_logprobs, output.prompt_logprobs, strict=True):
            seq = by_id.get(batch.seq_ids[spec.row])
            if seq is not None:
                seq.request.prompt_logprobs.extend(_logprobs(scored, j) for j in range(len(scored.token_ids)))

        updated: list[Sequence] = []
        for spec, sampled in zip(batch.samples, output.samples, strict=True):
            seq = by_id.get(spec.seq_id)
            if seq is None:
                continue
            seq.num_pending_tokens -= 1
            if spec.proposals:
                self._take_verified(seq, spec.proposals, sampled)
                updated.append(seq)
                continue
            targets = [seq]
            request = seq.request
            if spec.num_samples > 1:
                seq.penalty_counts_sent = False  # the sampler does not count a fork's draws
            if not request.forked:
                request.forked = True
                for i in range(1, spec.num_samples):
                    child = Sequence(next(self._seq_ids), request, list(seq.token_ids), sample_index=i)
                    bm.fork(seq, child)
                    child.status = SequenceStatus.RUNNING
                    self.seqs[child.seq_id] = child
                    self._enqueue(self.running, child)
                    request.sequences.append(child)
                    targets.append(child)
            for j, target in enumerate(targets):
                self._append_token(target, sampled, j)
                updated.append(target)
        return updated

    def _take_verified(self, seq: Sequence, proposals: list[int], sampled: SampledTokens) -> None:
        """Append what a speculative row emits (the proposals kept, then one token), and forget the K/V of those
        rejected: the sequence is computed up to its new last token, and the blocks past that are freed."""
        emitted = len(sampled.token_ids)
        self.num_spec_rows += 1
        self.num_spec_proposed += len(proposals)
        self.num_spec_accepted += emitted - 1
        self.spec_acceptance.add(len(proposals), emitted - 1)
        seq.spec_acceptance.record(len(proposals), emitted - 1)
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.rollback(seq, seq.num_tokens + emitted - 1)
            # A draft computed each proposal but the last: all kept, it lacks that one's K/V
            seq.draft_lag = self.speculative.method == "draft_model" and emitted - 1 == len(proposals)
        for j in range(emitted):
            self._append_token(seq, sampled, j)
            if seq.finished:
                break
        seq.num_new_tokens = j + 1

    def _append_token(self, seq: Sequence, sampled, j: int) -> None:
        token = sampled.token_ids[j]
        seq.token_ids.append(token)
        seq.num_new_tokens = 1
        if sampled.logprobs is not None:
            seq.logprobs.append(_logprobs(sampled, j))
        request = seq.request
        params = request.params
        if not params.ignore_eos and token in request.eos_token_ids:
            self.finish(seq, "stop")
        elif token in params.stop_token_ids:
            seq.stop_reason = token
            self.finish(seq, "stop")
        elif self._ends_by_length(seq, seq.num_tokens):
            self.finish(seq, "length")
        elif params.allowed_token_ids is not None and request.bans_by_history and set(params.allowed_token_ids) <= set(
                self._banned_tokens(seq, seq.num_tokens - seq.num_prompt_tokens) or ()):
            # Every allowed token would now complete a bad word: nothing may follow, and a draw from a row with
            # nothing left would be a token outside both rules.
            self.finish(seq, "stop")

    def _enqueue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
        """Into the running or waiting queue: at its place in order of urgency ("priority"), else at the end."""
        if self.by_priority:
            bisect.insort(queue, seq, key=_urgency)
        else:
            queue.append(seq)

    def requeue(self, request: Request) -> None:
        """Back to the waiting queue, ahead of those waiting, holding no blocks: its running sequences lost their
        K/V with the workers (a failed step may not have written its last block: none of it is cached)."""
        for seq in request.sequences:
            if seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
                self._back_to_waiting(seq, tail_written=False)

    def _preempt(self, seq: Sequence, tail_written: bool = True) -> None:
        self._back_to_waiting(seq, tail_written)
        self.num_preemptions += 1

    def _back_to_waiting(self, seq: Sequence, tail_written: bool) -> None:
        self._free_blocks(seq, tail_written)
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=_urgency)
        else:
            self.waiting.appendleft(seq)  # admitted before every sequence still waiting

    def _free_blocks(self, seq: Sequence, tail_written: bool = True) -> None:
        """Free the sequence's blocks, and its row of the workers' block table with them (see
        `BlockManager.free` for `tail_written`)."""
        self.block_manager.free(seq, tail_written)
        seq.penalty_counts_sent = False  # its slot's counts go with the slot
        seq.draft_lag = False  # recomputed from its first token not cached, the draft's K/V with it
        if seq.slot is not None:
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = None

    def _send_block_table(self, seq: Sequence, batch: StepBatch) -> None:
        """Give the sequence a row of the workers' block table if it has none, and add to the batch the
        entries the workers do not have yet."""
        if seq.slot is None:
            if self._free_slots:
                seq.slot = heapq.heappop(self._free_slots)
            else:
                seq.slot = self._num_slots
                self._num_slots += 1
        sent = seq.num_sent_blocks
        for g, table in enumerate(seq.block_tables):
            if sent[g] < len(table):
                batch.table_updates[g].append((seq.slot, sent[g], table[sent[g]:]))
                sent[g] = len(table)
        batch.slots.append(seq.slot)

    # ---- numbers -------------------------------------------------------------------------

    def num_running_requests(self) -> int:
        return len({s.request.request_id for s in self.running})

    def num_waiting_requests(self) -> int:
        return len({s.request.request_id for s in self.waiting} - {s.request.request_id for s in self.running})


def _logprobs(scored: SampledTokens, j: int) -> PositionLogprobs:
    """Token j's logprob and rank with its top k, ranked 1..k."""
    token = scored.token_ids[j]
    top = scored.top_logprobs[j] if scored.top_logprobs else []
    rank = scored.ranks[j] if scored.ranks is not None else None
    return PositionLogprobs(token, Logprob(scored.logprobs[j], rank, token_id=token),
                            [Logprob(v, r, token_id=t) for r, (t, v) in enumerate(top, 1)])


POLICIES = ("fcfs", "priority")
DRAFTED = -1  # a draft model's proposal's place in a row, its token made on the worker


def _urgency(seq: Sequence) -> tuple[int, int, int]:
    """The "priority" policy's order: the request's priority (lower first), then the order requests came."""
    return seq.request.params.priority, seq.request.arrival, seq.sample_index


def _seqs_to_come(seq: Sequence) -> int:
    """How many running sequences `seq` stands for: its request's n samples until it forks into them."""
    return 1 if seq.request.forked else seq.request.params.n
