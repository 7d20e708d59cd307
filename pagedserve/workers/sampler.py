"""Turns the logits of each sampling row into tokens: penalties, temperature, top-k/top-p/min-p,
greedy or seeded sampling, and logprobs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from pagedserve.scheduler.batch import SampledTokens, SampleSpec
from pagedserve.speculative.verify import verify_sampled
from pagedserve.workers.draw import draw_uniform, inverse_transform
from pagedserve.workers.penalties import PenaltyCounts
from pagedserve.workers.tensors import fill_at, on_device, on_device_packed, to_device


@dataclass
class Draws:
    """Tokens with their logprobs and ranks, still on the device: one step's draws, or the prompt tokens it scored.
    Made without waiting for the device, so that the next step can be launched behind them; `outputs`
    waits and reads them."""

    # (tokens, logprobs asked for) per SampleSpec (num_samples, params.logprobs) or per PromptLogprobSpec
    # (its target tokens, k): `outputs` gives one SampledTokens per group. None: no logprobs.
    groups: list[tuple[int, int | None]]
    tokens: torch.Tensor  # [D] the groups' tokens in order
    # [D, 2] each draw's logprob and rank (`token_scores`), when a spec asks for logprobs
    scores: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None  # [D, K], K the most top logprobs a spec asks for (K > 0)
    top_logprobs: torch.Tensor | None = None  # [D, K]
    # [G] how many of each group's tokens are its output: fewer than it holds where a speculative row kept only
    # some of its proposals. None: all.
    emitted: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def to_host(self) -> None:
        """Start copying the draws to host memory without waiting (CUDA); `outputs` waits for the copy."""
        if self.tokens.device.type != "cuda":
            return
        for name in ("tokens", "scores", "top_ids", "top_logprobs", "emitted"):
            t = getattr(self, name)
            if t is not None:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                setattr(self, name, host.copy_(t, non_blocking=True))
        self.ready = torch.cuda.Event()
        self.ready.record()

    def outputs(self) -> list[SampledTokens]:
        """Per group, its tokens (and logprobs when it asked for them)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.tokens.tolist()
        logprobs, ranks = self.scores.t().tolist() if self.scores is not None else (None, None)
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        emitted = self.emitted.tolist() if self.emitted is not None else [count for count, _ in self.groups]
        out: list[SampledTokens] = []
        pos = 0
        for (count, k), used in zip(self.groups, emitted, strict=True):
            rows = slice(pos, pos + used)
            if k is None:
                out.append(SampledTokens(token_ids=tokens[rows]))
            else:
                tops = _top_pairs(top_ids[rows], top_values[rows], k) if k > 0 else [[] for _ in range(used)]
                out.append(SampledTokens(token_ids=tokens[rows], logprobs=logprobs[rows], top_logprobs=tops,
                                         ranks=[int(r) for r in ranks[rows]]))
            pos += count
        return out


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        # Rows that penalties and grammar masks process together: on CUDA a row at a time is a few kernel
        # launches per row; on a CPU a row's [V] temporaries stay in cache and [64, V] ones do not (batched
        # penalties measured 2.3x and masks 3x slower there).
        self.rows_at_once = 64 if device.type == "cuda" else 1
        self.penalties = PenaltyCounts(rows_at_once=self.rows_at_once)

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampledTokens]:
        """logits [len(specs), V] fp32, one row per spec; a spec with num_samples=k draws k tokens."""
        return self.draw(logits, specs).outputs()

    def draw(self, logits: torch.Tensor, specs: list[SampleSpec], slots: list[int] | None = None,
             drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> Draws:
        """`__call__` without reading the draws back: nothing here waits for the device. `slots`: each spec's
        block-table slot, which keys its penalty counts (default: its index in `specs`). `logits` [P, V] hold
        each spec's `num_positions` rows in order: a speculative spec's proposals are verified against them.
        `drafts`: a draft model's proposals for the `draft` specs [Q] and their distributions [Q, V]."""
        dev = logits.device
        slots = list(range(len(specs))) if slots is None else slots
        rows: list[tuple[SampleSpec, int]] = []  # one per draw: (the spec as its position draws, sample i)
        draw_slots: list[int] = []
        before: list[list[int]] = []  # per draw: the proposals before its position, output as far as it knows
        for spec, slot in zip(specs, slots, strict=True):
            if spec.proposals:
                for j in range(spec.num_positions):
                    rows.append((_at_position(spec, j), 0))
                    before.append(spec.proposals[:j])
            else:
                rows += [(spec, i) for i in range(spec.num_samples)]
                before += [[]] * spec.num_samples
            draw_slots += [slot] * spec.num_tokens
        if len(rows) > logits.shape[0]:  # a request's first step draws its n samples from one row
            repeats = [n for s in specs for n in ([1] * s.num_positions if s.proposals else [s.num_samples])]
            logits = logits.repeat_interleave(on_device(dev, repeats, torch.long), dim=0, output_size=len(rows))
        k = [s.params.logprobs for s in specs if s.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if k else None  # [D, V]
        logits = self.penalties.apply(logits, rows, draw_slots, before)
        logits = _apply_bias_and_bans(logits, rows, self.rows_at_once)
        tokens = self._pick(logits, rows)  # [D]
        emitted = None
        if any(s.proposals for s in specs):
            tokens, emitted = self._verify(tokens, specs, logits, rows, drafts)
        self.penalties.record(rows, draw_slots, tokens, _counted(specs, emitted))
        draws = Draws([(s.num_tokens, s.params.logprobs) for s in specs], tokens, emitted=emitted)
        if raw_logprobs is not None:
            draws.scores, draws.top_logprobs, draws.top_ids = token_scores(raw_logprobs, tokens, max(k))
        return draws

    def _pick(self, logits: torch.Tensor, rows: list[tuple[SampleSpec, int]]) -> torch.Tensor:
        """Each row's token [D]: the argmax, or a draw from its distribution."""
        greedy_tokens = logits.argmax(dim=-1)
        drawn = [r for r, (s, _) in enumerate(rows) if not s.params.greedy]
        if not drawn:
            return greedy_tokens
        dev = logits.device
        # One uniform per draw instead of V exponentials for a race: 8x less time on a CPU. One for every row,
        # so that a row's uniform is the same whichever of the others draw.
        uniform = torch.rand(len(rows), 1, generator=self.generator, device=dev, dtype=logits.dtype)  # [D, 1]
        if len(drawn) < len(rows):  # a mixed batch: the greedy rows' [V] rows go no further than argmax
            index = on_device(dev, drawn)
            logits, uniform, rows = logits[index], uniform[index], [rows[r] for r in drawn]  # [S, V], [S, 1]
        probs = distributions(logits, rows)
        seeded = [(r, draw_uniform(spec.params.seed, spec.sample_index + i, spec.output_len))
                  for r, (spec, i) in enumerate(rows) if spec.params.seed is not None]
        if seeded:  # made on the host: no generator or kernel per seeded draw
            uniform[on_device(dev, [r for r, _ in seeded]), 0] = on_device(dev, [u for _, u in seeded], probs.dtype)
        sampled = inverse_transform(probs, uniform)
        if len(drawn) == len(greedy_tokens):
            return sampled
        return greedy_tokens.index_put_((index,), sampled)

    def _verify(self, tokens: torch.Tensor, specs: list[SampleSpec], logits: torch.Tensor,
                rows: list[tuple[SampleSpec, int]], drafts: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """What each spec emits: the tokens [D] with a speculative spec's replaced where it emits others, and how
        many of its tokens each emits [G].

        Proposals without a distribution (n-gram lookup), and a draft model's for greedy rows: a spec emits its
        proposals up to the first that is not the token its position draws, then that token. Each position's token
        is drawn as it would be one step at a time (the argmax, or the draw by its place's uniform: a seed's, or the
        generator's), so the tokens it emits are exactly those, greedy or seeded, whatever was proposed: the output
        with speculation is the output without. A proposal is kept with the probability its position's
        distribution gives it, as rejection sampling would keep a proposal that puts all its mass on one token.
        A draft model's proposals for sampled rows, drawn from its distributions q: rejection sampling
        (`speculative/verify.py`), whose output has the target's distribution (the tokens differ from those one
        step at a time)."""
        dev = tokens.device
        emitted = on_device(dev, [0 if s.proposals else s.num_samples for s in specs], torch.long)  # [G]
        starts = list(itertools.accumulate((s.num_tokens for s in specs), initial=0))
        proposed = self._proposals(specs, drafts, dev)  # [P], spec after spec
        first = list(itertools.accumulate((len(s.proposals or ()) for s in specs), initial=0))
        by_draw = [g for g, s in enumerate(specs) if s.proposals and not (s.draft and not s.params.greedy)]
        if by_draw:
            group, place, length = (list(c) for c in zip(
                *((g, j, len(specs[g].proposals)) for g in by_draw for j in range(len(specs[g].proposals))),
                strict=True))
            group_t, place_t, length_t, at, flat = on_device_packed(dev, [
                group, place, length, [starts[g] + j for g, j in zip(group, place, strict=True)],
                [first[g] + j for g, j in zip(group, place, strict=True)]])
            first_miss = torch.where(tokens[at] == proposed[flat], length_t, place_t)
            kept = emitted.scatter_reduce(0, group_t, first_miss, "amin", include_self=False)  # [G]
            emitted = torch.where(emitted == 0, kept + 1, emitted)
        by_length: dict[int, list[int]] = {}
        for g, s in enumerate(specs):
            if s.proposals and s.draft and not s.params.greedy:
                by_length.setdefault(len(s.proposals), []).append(g)
        for k, groups in by_length.items():  # rejection sampling, the rows with k proposals together
            rows_at = [starts[g] + j for g in groups for j in range(k + 1)]
            index = on_device(dev, rows_at)
            target = distributions(logits[index], [rows[r] for r in rows_at]).view(len(groups), k + 1, -1)
            flat = on_device(dev, [first[g] + j for g in groups for j in range(k)])
            draft_row = [sum(len(t.proposals) for t in specs[:g] if t.draft) for g in groups]
            q_index = on_device(dev, [d + j for d in draft_row for j in range(k)])
            positions = [[rows[r][0] for r in rows_at[b * (k + 1):(b + 1) * (k + 1)]] for b in range(len(groups))]
            accept_u, draw_u = self._verification_uniforms(positions, target.dtype, dev)
            proposals = proposed[flat].view(len(groups), k)
            q = drafts[1][q_index].view(len(groups), k, -1).to(target.dtype)  # [B, k, V]
            kept, following = verify_sampled(target, proposals, q, accept_u, draw_u)
            out = torch.cat([proposals, proposals[:, :1]], dim=1).scatter(1, kept[:, None], following[:, None])
            tokens = tokens.index_put((index,), out.flatten())
            emitted = emitted.index_put((on_device(dev, groups),), kept + 1)
        return tokens, emitted

    @staticmethod
    def _proposals(specs: list[SampleSpec], drafts: tuple[torch.Tensor, torch.Tensor] | None,
                   dev: torch.device) -> torch.Tensor:
        """Every spec's proposals in order [P]: the host's, and a draft model's in the `draft` specs' places."""
        proposed = on_device(dev, [t for s in specs for t in (s.proposals or ())], torch.long)
        drafted = [i for i, is_draft in enumerate(s.draft for s in specs for _ in (s.proposals or ())) if is_draft]
        if drafted:
            if drafts is None:
                raise RuntimeError("the step has a draft model's proposal slots but no draft's proposals")
            proposed[on_device(dev, drafted)] = drafts[0]
        return proposed

    def _verification_uniforms(self, positions: list[list[SampleSpec]], dtype: torch.dtype, dev: torch.device
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of B, the uniforms [B, k] that test its k proposals and [B, k + 1] that draw the token after
        the last kept, from its positions' specs: a seeded row's from its seed and each position's place (the
        draw the one a step without speculation makes there), others' from the generator."""
        num_rows, width = len(positions), len(positions[0])
        accept = torch.rand(num_rows, width - 1, generator=self.generator, device=dev, dtype=dtype)  # [B, k]
        draw = torch.rand(num_rows, width, generator=self.generator, device=dev, dtype=dtype)  # [B, k + 1]
        seeded = [b for b, specs in enumerate(positions) if specs[0].params.seed is not None]
        if seeded:
            index = on_device(dev, seeded)
            accept[index] = on_device(dev, [draw_uniform(s.params.seed, s.sample_index, s.output_len, stream=1)
                                            for b in seeded for s in positions[b][:-1]], dtype).view(-1, width - 1)
            draw[index] = on_device(dev, [draw_uniform(s.params.seed, s.sample_index, s.output_len)
                                          for b in seeded for s in positions[b]], dtype).view(-1, width)
        return accept, draw


def _at_position(spec: SampleSpec, j: int) -> SampleSpec:
    """A speculative spec as the draw at its j-th position sees it: j tokens further into the output."""
    if j == 0:
        return replace(spec, proposals=None, proposal_bans=None, proposal_bitmasks=None)
    bans = spec.proposal_bans[j - 1] if spec.proposal_bans else None
    mask = spec.proposal_bitmasks[j - 1] if spec.proposal_bitmasks else None
    return replace(spec, output_len=spec.output_len + j, banned_token_ids=bans, token_bitmask=mask, proposals=None,
                   proposal_bans=None, proposal_bitmasks=None)


def _counted(specs: list[SampleSpec], emitted: torch.Tensor | None) -> torch.Tensor | None:
    """Per draw [D], whether its token is output (a speculative spec's past what it emits are not); None: all."""
    if emitted is None:
        return None
    dev = emitted.device
    place = on_device(dev, [j for s in specs for j in range(s.num_tokens)], torch.long)  # [D]
    group = on_device(dev, [g for g, s in enumerate(specs) for _ in range(s.num_tokens)], torch.long)
    return place < torch.where(emitted[group] > 0, emitted[group], 1)


def distributions(logits: torch.Tensor, rows: list[tuple[SampleSpec, int]]) -> torch.Tensor:
    """What each row draws from [S, V]: temperature, top-k, top-p, then min-p (unnormalised where min-p cuts)."""
    dev = logits.device
    temperature = on_device(dev, [s.params.temperature for s, _ in rows], logits.dtype)
    logits = logits / temperature[:, None]
    top_k = [s.params.top_k for s, _ in rows]
    top_p = [s.params.top_p for s, _ in rows]
    if any(k != -1 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if any(s.params.min_p > 0 for s, _ in rows):
        min_p = on_device(dev, [s.params.min_p for s, _ in rows], probs.dtype)
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs


def token_scores(logprobs: torch.Tensor, tokens: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """On the device, nothing read back: each of `tokens` [S]'s logprob under `logprobs` [S, V] and its rank,
    as [S, 2] (one copy to the host for both), and when k > 0 each row's top k values and ids ([S, k],
    sorted; their ranks are 1..k). A token's rank is vLLM's: how many tokens are at least as likely."""
    token_logprobs = logprobs.gather(1, tokens[:, None])  # [S, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=1, keepdim=True)  # [S, 1]
    scores = torch.cat([token_logprobs.float(), ranks.float()], dim=1)  # [S, 2]: fp32 holds ranks < 2^24 exactly
    if k == 0:
        return scores, None, None
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return scores, top_values, top_ids


def _top_pairs(ids: list[list[int]], values: list[list[float]], k: int) -> list[list[tuple[int, float]]]:
    """Each row's top k (id, logprob) pairs from its sorted top K >= k: a spec asking for fewer than the
    step's most takes the first k."""
    return [list(zip(i[:k], v[:k], strict=True)) for i, v in zip(ids, values, strict=True)]


def _apply_bias_and_bans(logits: torch.Tensor, rows: list[tuple[SampleSpec, int]],
                         mask_rows_at_once: int) -> torch.Tensor:
    """logit_bias added, then tokens banned by min_tokens or a bad word, outside allowed_token_ids or
    masked by a grammar set to -inf (a bias cannot lift a ban): biases and bans for all rows at once,
    masks over the whole vocabulary (allowed_token_ids, a grammar's) `mask_rows_at_once` rows at a time."""
    dev = logits.device
    bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
    masked: list[int] = []
    masks: list[bytes | list[int]] = []  # a grammar's token bitmask, or the allowed token ids
    for r, (spec, _) in enumerate(rows):
        bias = spec.params.logit_bias
        if bias:
            bias_rows += [r] * len(bias)
            bias_ids += bias
            bias_values += bias.values()
        if spec.banned_token_ids:
            ban_rows += [r] * len(spec.banned_token_ids)
            ban_ids += spec.banned_token_ids
        mask = spec.token_bitmask if spec.token_bitmask is not None else spec.params.allowed_token_ids
        if mask is not None:  # never both: SamplingParams refuses allowed_token_ids with a grammar
            masked.append(r)
            masks.append(mask)
    if bias_rows:
        index = on_device_packed(dev, [bias_rows, bias_ids])
        logits.index_put_(tuple(index), on_device(dev, bias_values, logits.dtype), accumulate=True)
    for c in range(0, len(masked), mask_rows_at_once):
        part = masked[c:c + mask_rows_at_once]
        banned = ~_allowed_rows(masks[c:c + mask_rows_at_once], logits.shape[-1], dev)  # [M, V]
        if len(part) == 1:
            logits[part[0]].masked_fill_(banned[0], float("-inf"))
        else:
            rows_index = on_device(dev, part)
            logits[rows_index] = logits[rows_index].masked_fill(banned, float("-inf"))
    if ban_rows:
        fill_at(logits, tuple(on_device_packed(dev, [ban_rows, ban_ids])), float("-inf"))
    return logits


def _allowed_rows(masks: list[bytes | list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Grammar bitmasks and allowed token ids as bool rows [len(masks), vocab]."""
    listed = [i for i, m in enumerate(masks) if not isinstance(m, bytes)]
    if not listed:
        return _allowed(masks, vocab, device)
    allowed = torch.zeros(len(masks), vocab, dtype=torch.bool, device=device)  # [M, V]
    if len(listed) < len(masks):
        bitmasked = [i for i, m in enumerate(masks) if isinstance(m, bytes)]
        allowed[on_device(device, bitmasked)] = _allowed([masks[i] for i in bitmasked], vocab, device)
    pairs = [(i, t) for i in listed for t in masks[i]]
    fill_at(allowed, tuple(on_device_packed(device, [[i for i, _ in pairs], [t for _, t in pairs]])), True)
    return allowed


def _allowed(bitmasks: list[bytes], vocab: int, device: torch.device) -> torch.Tensor:
    """Token bitmasks as bool rows [len(bitmasks), vocab]."""
    words = to_device(torch.frombuffer(bytearray(b"".join(bitmasks)), dtype=torch.int32), device)
    words = words.view(len(bitmasks), -1)  # [M, ceil(V / 32)]
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1  # [M, W, 32]
    return bits.flatten(1)[:, :vocab].bool()


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf (in place where `logits` has rows
    that ask for neither: only the others are restricted)."""
    restricted = [r for r, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k != -1 or p < 1.0]
    if len(restricted) < len(top_k):
        index = on_device(logits.device, restricted)
        logits[index] = _top_k_top_p(logits[index], [top_k[r] for r in restricted], [top_p[r] for r in restricted])
        return logits
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" or all(0 < k < vocab for k in top_k):
        # On CUDA only when every row has a top-k: its nucleus then lies among its k largest, and nothing is
        # read back to the host
        return _top_k_top_p_among_candidates(logits, top_k, top_p)
    return _top_k_top_p_sorted(logits, top_k, top_p)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`_top_k_top_p` by sorting every row: nothing to read back on the host (no device sync)."""
    vocab = logits.shape[-1]
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    k = on_device(dev, [vocab if k == -1 else min(k, vocab) for k in top_k], torch.long)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = on_device(dev, top_p, logits.dtype)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token if the mass before it is below top_p: the first token always stays. A row with top_p = 1
    # keeps all: its rounded mass may reach 1 before its last tokens.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= p[:, None]) & (p[:, None] < 1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


_TOP_P_CANDIDATES = 1024  # a top-p row's largest logits among which its nucleus is sought first


def _top_k_top_p_among_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`_top_k_top_p` by a partial selection instead of sorting whole rows (on a CPU a sort of a large
    vocabulary's row costs milliseconds): each row's nucleus is sought among its largest k (top-k rows) or
    `_TOP_P_CANDIDATES` logits, and only a row without top-k whose candidates hold less than top_p of its mass
    is sorted whole (which reads back to the host). The same tokens stay as with the sort: a nucleus inside
    the candidates is the sorted row's."""
    vocab = logits.shape[-1]
    dev = logits.device
    ks = [vocab if k == -1 else min(k, vocab) for k in top_k]
    whole = [k == vocab for k in ks]  # rows without top-k: top-p weighs the whole row
    free = [w and p >= 1.0 for w, p in zip(whole, top_p, strict=True)]  # rows that keep every token
    width = min(vocab, max((k if k < vocab else _TOP_P_CANDIDATES for k, f in zip(ks, free, strict=True) if not f),
                           default=1))
    values, order = logits.topk(width, dim=-1)  # [S, W], each row's largest, descending
    k = on_device(dev, ks)
    values = values.masked_fill(torch.arange(width, device=dev)[None, :] >= k[:, None], float("-inf"))
    # Top-p weighs the top-k distribution: normalised over the k kept, or over the whole row without top-k.
    log_norm = values.logsumexp(dim=-1, keepdim=True)  # [S, 1]
    if any(whole):  # a pass over the whole rows only when one needs it
        log_norm = torch.where(on_device(dev, whole, torch.bool)[:, None], logits.logsumexp(dim=-1, keepdim=True),
                               log_norm)
    probs = (values - log_norm).exp()  # [S, W]
    mass = probs.cumsum(dim=-1)
    p = on_device(dev, top_p, logits.dtype)
    values = values.masked_fill((mass - probs >= p[:, None]) & (p[:, None] < 1), float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter(1, order, values)
    for r in range(len(ks)):
        if free[r]:
            out[r] = logits[r]
    if any(w and not f for w, f in zip(whole, free, strict=True)):
        short = (mass[:, -1] < p).tolist()  # a row without top-k whose nucleus reaches past the candidates
        for r in range(len(ks)):
            if whole[r] and not free[r] and short[r]:
                out[r] = _top_k_top_p_sorted(logits[r:r + 1], [top_k[r]], [top_p[r]])[0]
    return out
