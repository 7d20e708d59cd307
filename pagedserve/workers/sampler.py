"""Turns the logits of each sampling row into tokens: penalties, temperature, top-k/top-p/min-p,
greedy or seeded sampling, and logprobs."""

from __future__ import annotations

import torch
import xxhash

from pagedserve.scheduler.batch import SampledTokens, SampleSpec


def draw_seed(seed: int, sample_index: int, output_len: int) -> int:
    """Seed of one draw: a function of the request's seed and the draw's place only, so the
    same seed gives the same tokens whatever else is in the batch, even after preemption."""
    data = b"".join(x.to_bytes(8, "little", signed=True) for x in (seed, sample_index, output_len))
    return xxhash.xxh64_intdigest(data) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampledTokens]:
        """logits [len(specs), V] fp32, one row per spec; a spec with num_samples=k draws k tokens."""
        if not specs:
            return []
        rows = [(s, i) for s in specs for i in range(s.num_samples)]
        if len(rows) > len(specs):  # a request's first step draws its n samples from one row
            counts = torch.tensor([s.num_samples for s in specs], device=logits.device)
            logits = logits.repeat_interleave(counts, dim=0)  # [S, V], one row per draw
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None
                                                                 for s in specs) else None
        logits = self._apply_penalties(logits, rows)
        logits = _apply_bias_and_bans(logits, rows)
        tokens = self._pick(logits, rows)

        token_list = tokens.tolist()  # one device sync for the whole batch
        out: list[SampledTokens] = []
        pos = 0
        for spec in specs:
            rows_of_spec = slice(pos, pos + spec.num_samples)
            k = spec.params.logprobs
            if k is None:
                out.append(SampledTokens(token_ids=token_list[rows_of_spec]))
            else:
                out.append(score_tokens(raw_logprobs[rows_of_spec], tokens[rows_of_spec], k))
            pos += spec.num_samples
        return out

    def _apply_penalties(self, logits: torch.Tensor, rows: list[tuple[SampleSpec, int]]) -> torch.Tensor:
        for r, (spec, _) in enumerate(rows):
            p = spec.params
            if not p.needs_penalties:
                continue
            row = logits[r]
            output = torch.tensor(spec.output_token_ids or [], dtype=torch.long, device=row.device)
            if p.repetition_penalty != 1.0:
                seen = torch.cat([torch.tensor(spec.prompt_token_ids, dtype=torch.long, device=row.device),
                                  output]).unique()
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                        values * p.repetition_penalty)
            if output.numel() and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
                counts = torch.bincount(output, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _pick(self, logits: torch.Tensor, rows: list[tuple[SampleSpec, int]]) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if all(s.params.greedy for s, _ in rows):
            return greedy_tokens
        dev = logits.device
        temperature = torch.tensor([s.params.temperature or 1.0 for s, _ in rows], device=dev)
        logits = logits / temperature[:, None]
        top_k = [s.params.top_k for s, _ in rows]
        top_p = [s.params.top_p for s, _ in rows]
        if any(k != -1 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([s.params.min_p for s, _ in rows], device=dev)
        if bool((min_p > 0).any()):
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        # Exponential race (Gumbel-max in disguise): argmax(p / E), E ~ Exp(1), samples from p.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for r, (spec, i) in enumerate(rows):
            if spec.params.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(draw_seed(spec.params.seed, spec.sample_index + i, spec.output_len))
                noise[r].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([s.params.greedy for s, _ in rows], device=dev)
        return torch.where(is_greedy, greedy_tokens, sampled)


def score_tokens(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> SampledTokens:
    """`tokens` [S] with their logprobs under `logprobs` [S, V], and each row's top `k`."""
    sampled = SampledTokens(token_ids=tokens.tolist(),
                            logprobs=logprobs.gather(1, tokens[:, None]).squeeze(1).tolist())
    if k > 0:
        top_v, top_i = logprobs.topk(k, dim=-1)
        sampled.top_logprobs = [list(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(), top_v.tolist(),
                                                                            strict=True)]
    else:
        sampled.top_logprobs = [[] for _ in range(len(tokens))]
    return sampled


def _apply_bias_and_bans(logits: torch.Tensor, rows: list[tuple[SampleSpec, int]]) -> torch.Tensor:
    """logit_bias added, then tokens banned by min_tokens or a grammar masked (a bias cannot lift a ban)."""
    for r, (spec, _) in enumerate(rows):
        if spec.token_bitmask is not None:
            logits[r].masked_fill_(~_allowed(spec.token_bitmask, logits.shape[-1], logits.device), float("-inf"))
        bias = spec.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[r, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        if spec.banned_token_ids:
            logits[r, spec.banned_token_ids] = float("-inf")
    return logits


def _allowed(bitmask: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    """A token bitmask as a bool vector [vocab]."""
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).to(device)  # [ceil(V / 32)]
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1  # [W, 32]
    return bits.flatten()[:vocab].bool()


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    vocab = logits.shape[-1]
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    k = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_k], device=dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=dev, dtype=logits.dtype)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token if the mass before it is below top_p: the first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
