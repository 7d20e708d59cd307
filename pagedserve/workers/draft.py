"""A draft model's proposals, made on the worker beside the target model (speculative decoding's `draft_model`).

The draft keeps a KV pool of its own indexed by the target's block ids: the same block tables serve both, so the
block manager allocates, shares, copies and frees for both at once. A step runs the draft first:

1. one pass over every row's known tokens (what the target computes this step, less the proposals' slots), so
   that the draft's K/V follow the target's; a row whose last proposals were all kept starts one token earlier,
   the last of them, which no draft pass computed (`StepBatch.draft_catch_up`);
2. for each row with proposal slots, its first proposal from the first pass's logits at its last known token, then
   one pass per further proposal over the rows that want it, each computing the proposal before.

Proposals are the draft's argmax for greedy rows and a draw from its distribution (the row's temperature, top-k,
top-p and min-p) for the others, whose distributions `q` rejection sampling then weighs (`speculative/verify.py`).
What the draft computes never reaches the output unverified: a draft K/V that is stale (a cached block another
sequence computed while its draft lagged) only lowers how often proposals are kept.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.kernels.backend import AttentionBackend, AttentionContext
from pagedserve.kernels.cpu.native_forward import native_forward
from pagedserve.scheduler.batch import SampleSpec, StepBatch
from pagedserve.workers.block_tables import BlockTables
from pagedserve.workers.draw import draw_uniform, inverse_transform
from pagedserve.workers.kv_pool import layer_caches
from pagedserve.workers.models.llama import CausalLM
from pagedserve.workers.sampler import distributions
from pagedserve.workers.tensors import on_device, on_device_packed

DRAFT_STREAM = 2  # the seeded uniforms of a draft's draws, apart from the target's (`draw_uniform`)


class DraftRunner:
    def __init__(self, model: CausalLM, kv_pool: torch.Tensor, backend: AttentionBackend, block_size: int,
                 generator: torch.Generator) -> None:
        self.model = model
        self.kv_pool = kv_pool  # [layers, 2, N, B, Hkv, D]: the target's block ids, the draft's layers
        self.kv_caches = layer_caches(model.config, kv_pool)
        self.backend = backend
        self.block_size = block_size
        self.generator = generator
        self.native_forward = native_forward(model, kv_pool, backend)

    @torch.inference_mode()
    def propose(self, batch: StepBatch, input_ids: torch.Tensor, tables: BlockTables
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's proposals for the batch's `draft` samples, in order [P], and their distributions [P, V]
        (one-hot for greedy rows); with none, the draft computes the step's known tokens' K/V alone. `input_ids`
        [T]: the step's inputs, deferred ones filled in."""
        drafted = [s for s in batch.samples if s.draft]
        catch_up = dict(batch.draft_catch_up)
        cu = batch.cu_seqlens_q
        proposals_in = {s.row: len(s.proposals) for s in drafted}
        # Pass 1: every row's known tokens, after its catch-up token
        index, fills, q_lens, ctx_lens = [], [], [], []  # index: into input_ids; fills: (place, catch-up token)
        for r in range(batch.num_rows):
            known_end = cu[r + 1] - proposals_in.get(r, 0)
            if r in catch_up:
                fills.append((len(index), catch_up[r]))
                index.append(cu[r])  # a placeholder, overwritten
            index += range(cu[r], known_end)
            q_lens.append(known_end - cu[r] + (r in catch_up))
            ctx_lens.append(batch.context_lens[r] - proposals_in.get(r, 0))
        dev = input_ids.device
        tokens = input_ids[on_device(dev, index)]  # [T1], a copy
        if fills:
            tokens[on_device(dev, [at for at, _ in fills])] = on_device(dev, [t for _, t in fills])
        hidden = self._forward(tokens, batch.slots, q_lens, ctx_lens, tables)
        if not drafted:  # a step of prefill chunks or rows without proposals: the draft's K/V only
            return tokens[:0], hidden.new_zeros((0, 0))
        last = torch.tensor(q_lens).cumsum(0) - 1  # each row's last known token in pass 1
        logits = self.model.compute_logits(hidden[on_device(dev, [int(last[s.row]) for s in drafted])])  # [S, V]
        out_tokens: list[list[torch.Tensor]] = [[] for _ in drafted]
        out_probs: list[list[torch.Tensor]] = [[] for _ in drafted]
        active = list(range(len(drafted)))  # the samples whose rows want another proposal; `logits` row each
        for j in range(max(len(s.proposals) for s in drafted)):
            picked, probs = self._pick(logits, [replace(drafted[i], output_len=drafted[i].output_len + j)
                                                for i in active])
            for n, i in enumerate(active):
                out_tokens[i].append(picked[n:n + 1])
                out_probs[i].append(probs[n:n + 1])
            wanting = [n for n, i in enumerate(active) if len(drafted[i].proposals) > j + 1]
            if not wanting:
                break
            # The next pass: each row that wants another proposal computes the one it just drew
            active = [active[n] for n in wanting]
            step_tokens = picked[on_device(dev, wanting)] if len(wanting) < len(picked) else picked
            rows_now = [drafted[i].row for i in active]
            hidden = self._forward(step_tokens, [batch.slots[r] for r in rows_now], [1] * len(active),
                                   [ctx_lens[r] + j + 1 for r in rows_now], tables)
            logits = self.model.compute_logits(hidden)  # [A, V]
        tokens_out = torch.cat([t for per in out_tokens for t in per])  # [P]
        probs_out = torch.cat([p for per in out_probs for p in per])  # [P, V]
        return tokens_out, probs_out

    def _pick(self, logits: torch.Tensor, specs: list[SampleSpec]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's proposal [S] and the distribution it was drawn from [S, V]: the argmax (one-hot) for greedy
        rows, a draw from the row's sampling distribution for the others (seeded ones by their place)."""
        dev = logits.device
        logits = logits.float()
        greedy = [s.params.greedy for s in specs]
        tokens = logits.argmax(dim=-1)  # [S]
        probs = torch.nn.functional.one_hot(tokens, logits.shape[-1]).to(logits.dtype)  # [S, V]
        drawn = [i for i, g in enumerate(greedy) if not g]
        if drawn:
            index = on_device(dev, drawn)
            rows = [(specs[i], 0) for i in drawn]
            q = distributions(logits[index], rows)  # [D, V]
            q = q / q.sum(dim=-1, keepdim=True)
            uniform = torch.rand(len(drawn), 1, generator=self.generator, device=dev, dtype=q.dtype)
            seeded = [(n, draw_uniform(s.params.seed, s.sample_index, s.output_len, stream=DRAFT_STREAM))
                      for n, (s, _) in enumerate(rows) if s.params.seed is not None]
            if seeded:
                uniform[on_device(dev, [n for n, _ in seeded]), 0] = on_device(dev, [u for _, u in seeded], q.dtype)
            tokens = tokens.index_put((index,), inverse_transform(q, uniform))
            probs = probs.index_put((index,), q)
        return tokens, probs

    def _forward(self, input_ids: torch.Tensor, slots: list[int], q_lens: list[int], context_lens: list[int],
                 tables: BlockTables) -> torch.Tensor:
        """The draft's hidden states [T, H] for rows of `q_lens` query tokens each ending at `context_lens`, in the
        block tables' rows `slots` (its K/V written to the same block ids as the target's)."""
        dev = input_ids.device
        bs = self.block_size
        num_rows = len(slots)
        row_of_token = [r for r in range(num_rows) for _ in range(q_lens[r])]
        positions = [context_lens[r] - q_lens[r] + i for r in range(num_rows) for i in range(q_lens[r])]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        positions_t, row_t, cu_t, ctx_t, slots_t = on_device_packed(dev, [positions, row_of_token, cu, context_lens,
                                                                          slots])
        max_context = max(context_lens)
        block_tables = tables.rows(slots_t, (max(slots) + 1, -(-max_context // bs)))  # [R, blocks]
        slot_mapping = block_tables[row_t, positions_t // bs] * bs + positions_t % bs  # [T]
        ctx = AttentionContext(backend=self.backend, slot_mapping=slot_mapping, cu_seqlens_q=cu_t, context_lens=ctx_t,
                               block_tables=block_tables, max_query_len=max(q_lens), max_context_len=max_context)
        if self.native_forward is not None:
            return self.native_forward(input_ids, positions_t, ctx)
        return self.model(input_ids, positions_t, self.kv_caches, ctx)
