"""Repetition, presence and frequency penalties, from token counts the sampler keeps per sequence."""

from __future__ import annotations

import torch

from pagedserve.scheduler.batch import SampleSpec
from pagedserve.workers.tensors import fill_at, grown, on_device, on_device_packed


def _penalized(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, repetition, frequency,
               presence) -> torch.Tensor:
    """`logits` [..., V] with the repetition penalty on every token seen in the prompt or the output, then
    the frequency and presence penalties on the output's tokens (`counts` [..., V] of each)."""
    seen = in_prompt | (counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - (frequency * counts + presence * (counts > 0).to(logits.dtype))


class PenaltyCounts:
    """Per block-table slot (`StepBatch.slots`): which tokens the sequence's prompt holds, and how often it
    has output each token, on the sampler's device.

    A sequence's history crosses to the worker once, with its first penalized draw in its slot
    (`SampleSpec.prompt_token_ids` and `output_token_ids`); from then on the sampler counts each token it
    draws for it. So a step carries no token history, and penalties cost a few batched operations per step
    whatever the rows' lengths. The scheduler sends the history again whenever this count may be off: a new
    slot, a preemption, the fork into n samples, a failed step.

    `rows_at_once` > 1 penalizes that many rows together, a few kernels for many rows (a GPU: 64 x a 152k
    vocabulary is 39 MB per temporary); 1 goes a row at a time, its [V] vectors staying in the caches where
    [rows, V] temporaries would not (a CPU: twice as fast at 256 rows of a 49k vocabulary)."""

    def __init__(self, rows_at_once: int = 1) -> None:
        self.rows_at_once = rows_at_once
        self.in_prompt: torch.Tensor | None = None  # [slots, V] bool, made with the first penalized draw
        self.output_counts: torch.Tensor | None = None  # [slots, V] in the logits' dtype
        self._owner: dict[int, int] = {}  # slot -> the sequence whose counts it holds

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, rows: list[tuple[SampleSpec, int]], slots: list[int],
              before: list[list[int]] | None = None) -> torch.Tensor:
        """Penalize `logits` [D, V] in place, one row per draw (`rows`: (spec, i-th sample), `slots`: each
        draw's slot). `before`: per draw, tokens output before it that the counts do not hold yet (the proposals
        ahead of a speculative position)."""
        penalized = [r for r, (spec, _) in enumerate(rows) if spec.params.needs_penalties]
        if not penalized:
            return logits
        dev = logits.device
        if self.in_prompt is None:
            self.in_prompt = torch.zeros((0, logits.shape[1]), dtype=torch.bool, device=dev)
            self.output_counts = torch.zeros((0, logits.shape[1]), dtype=logits.dtype, device=dev)
        shape = (max(slots[r] for r in penalized) + 1, logits.shape[1])
        self.in_prompt, self.output_counts = grown(self.in_prompt, shape), grown(self.output_counts, shape)
        self._rebuild([(rows[r][0], slots[r]) for r in penalized], dev)
        for r in penalized:
            spec = rows[r][0]
            if self._owner.get(slots[r]) != spec.seq_id:
                raise RuntimeError(f"sequence {spec.seq_id}'s penalties need its token history: slot {slots[r]} "
                                   "holds no counts of it")
        if self.rows_at_once > 1:
            for c in range(0, len(penalized), self.rows_at_once):
                part = penalized[c:c + self.rows_at_once]
                index, slot_index = on_device(dev, part), on_device(dev, [slots[r] for r in part])
                params = [rows[r][0].params for r in part]
                counts = self.output_counts[slot_index]  # [rows, V], a copy
                extra = [(i, t) for i, r in enumerate(part) for t in (before[r] if before else ())]
                if extra:
                    self._add(counts, extra)
                logits[index] = _penalized(
                    logits[index], counts, self.in_prompt[slot_index],
                    *(on_device(dev, [getattr(p, name) for p in params], logits.dtype)[:, None]  # [rows, 1]
                      for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")))
        else:
            for r in penalized:
                p, slot = rows[r][0].params, slots[r]
                counts = self.output_counts[slot]
                if before and before[r]:
                    counts = counts[None].clone()  # [1, V]
                    self._add(counts, [(0, t) for t in before[r]])
                    counts = counts[0]
                logits[r] = _penalized(logits[r], counts, self.in_prompt[slot],
                                       p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        return logits

    @staticmethod
    def _add(counts: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """One more of token t in row i of `counts` [rows, V] for each (i, t) (repeats add up)."""
        _accumulate(counts, *on_device_packed(counts.device, [[i for i, _ in pairs], [t for _, t in pairs]]))

    @torch.inference_mode()
    def record(self, rows: list[tuple[SampleSpec, int]], slots: list[int], tokens: torch.Tensor,
               counted: torch.Tensor | None = None) -> None:
        """Count the step's draws `tokens` [D] as their sequences' outputs, those where `counted` [D] is true
        (None: all; a speculative row's tokens past what it emits are not output). A fork's n draws go to n new
        sequences, whose histories come with their first draws: its slot's counts are dropped."""
        counts_rows = []
        for r, (spec, i) in enumerate(rows):
            if not spec.params.needs_penalties:
                continue
            if spec.num_samples == 1:
                counts_rows.append(r)
            elif i == 0:
                self._owner.pop(slots[r], None)
        if counts_rows:
            index = on_device(tokens.device, counts_rows)
            weights = None if counted is None else counted[index].to(self.output_counts.dtype)
            self._count(on_device(tokens.device, [slots[r] for r in counts_rows]), tokens[index], weights)

    def _count(self, slots: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """One more output of each `tokens`[i] in slot `slots`[i] (repeats add up), or `weights`[i] more."""
        _accumulate(self.output_counts, slots, tokens, weights)

    def _rebuild(self, penalized: list[tuple[SampleSpec, int]], dev: torch.device) -> None:
        """Reset the counts of the slots whose sequence's history came with this step, from that history."""
        # slot -> the spec that brought its history (a fork's n draws share one slot and one spec)
        fresh = {slot: spec for spec, slot in penalized if spec.prompt_token_ids is not None}
        if not fresh:
            return
        slot_index = on_device(dev, list(fresh))
        fill_at(self.in_prompt, (slot_index,), False)
        fill_at(self.output_counts, (slot_index,), 0)
        fill_at(self.in_prompt, (on_device(dev, [slot for slot, spec in fresh.items() for _ in spec.prompt_token_ids]),
                                 on_device(dev, [t for spec in fresh.values() for t in spec.prompt_token_ids])), True)
        outputs = [(slot, t) for slot, spec in fresh.items() for t in spec.output_token_ids or ()]
        if outputs:
            self._count(*(on_device(dev, list(column)) for column in zip(*outputs, strict=True)))
        for slot, spec in fresh.items():
            self._owner[slot] = spec.seq_id


def _accumulate(counts: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                weights: torch.Tensor | None = None) -> None:
    """counts[rows[i], tokens[i]] += weights[i] (1 where None), repeats adding up."""
    if weights is None:
        weights = torch.ones(len(rows), dtype=counts.dtype, device=counts.device)
    counts.index_put_((rows, tokens), weights, accumulate=True)
