"""Repetition, presence and frequency penalties, from token counts the sampler keeps per sequence."""

from __future__ import annotations

import torch

from pagedserve.scheduler.batch import SampleSpec
from pagedserve.workers.device import on_device


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
        self.in_prompt: torch.Tensor | None = None  # [slots, V] bool
        self.output_counts: torch.Tensor | None = None  # [slots, V] fp32
        self._owner: dict[int, int] = {}  # slot -> the sequence whose counts it holds

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, rows: list[tuple[SampleSpec, int]], slots: list[int],
              last_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Penalize `logits` [D, V] in place, one row per draw (`rows`: (spec, i-th sample), `slots`: each
        draw's slot). `last_inputs` [D]: each draw's row's last input, which a `last_output_pending` spec's
        history lacks."""
        penalized = [r for r, (spec, _) in enumerate(rows) if spec.params.needs_penalties]
        if not penalized:
            return logits
        dev = logits.device
        self._grow(max(slots[r] for r in penalized) + 1, logits.shape[1], dev, logits.dtype)
        self._rebuild([(rows[r][0], slots[r], r) for r in penalized], last_inputs, dev)
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
                logits[index] = _penalized(
                    logits[index], self.output_counts[slot_index], self.in_prompt[slot_index],
                    *(on_device(dev, [getattr(p, name) for p in params], logits.dtype)[:, None]  # [rows, 1]
                      for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")))
        else:
            for r in penalized:
                p, slot = rows[r][0].params, slots[r]
                logits[r] = _penalized(logits[r], self.output_counts[slot], self.in_prompt[slot],
                                       p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        return logits

    @torch.inference_mode()
    def record(self, rows: list[tuple[SampleSpec, int]], slots: list[int], tokens: torch.Tensor) -> None:
        """Count the step's draws `tokens` [D] as their sequences' outputs. A fork's n draws go to n new
        sequences, whose histories come with their first draws: its slot's counts are dropped."""
        counted = []
        for r, (spec, i) in enumerate(rows):
            if not spec.params.needs_penalties:
                continue
            if spec.num_samples == 1:
                counted.append(r)
            elif i == 0:
                self._owner.pop(slots[r], None)
        if counted:
            dev = tokens.device
            index = (on_device(dev, [slots[r] for r in counted]), tokens[on_device(dev, counted)])
            self.output_counts.index_put_(index, torch.ones(len(counted), dtype=self.output_counts.dtype,
                                                            device=dev), accumulate=True)

    def _rebuild(self, penalized: list[tuple[SampleSpec, int, int]], last_inputs: torch.Tensor | None,
                 dev: torch.device) -> None:
        """Reset the counts of the slots whose sequence's history came with this step, from that history."""
        fresh: dict[int, tuple[SampleSpec, int]] = {}  # slot -> (spec, its first draw's row); a fork's draws share
        for spec, slot, r in penalized:
            if spec.prompt_token_ids is not None:
                fresh.setdefault(slot, (spec, r))
        if not fresh:
            return
        slot_index = on_device(dev, list(fresh))
        self.in_prompt[slot_index] = False
        self.output_counts[slot_index] = 0
        prompt_slots = [slot for slot, (spec, _) in fresh.items() for _ in spec.prompt_token_ids]
        self.in_prompt[on_device(dev, prompt_slots), on_device(dev, [
            t for spec, _ in fresh.values() for t in spec.prompt_token_ids])] = True
        output_slots = [slot for slot, (spec, _) in fresh.items() for _ in spec.output_token_ids or ()]
        output_tokens = [t for spec, _ in fresh.values() for t in spec.output_token_ids or ()]
        pending = [(slot, r) for slot, (spec, r) in fresh.items() if spec.last_output_pending]
        if pending and last_inputs is None:
            spec = fresh[pending[0][0]][0]
            raise ValueError(f"sequence {spec.seq_id}'s last output token is pending, but no row inputs were "
                             "given to take it from")
        slots_t = on_device(dev, output_slots + [slot for slot, _ in pending])
        tokens_t = on_device(dev, output_tokens)
        if pending:
            tokens_t = torch.cat([tokens_t, last_inputs[on_device(dev, [r for _, r in pending])]])
        if len(slots_t):
            self.output_counts.index_put_((slots_t, tokens_t), torch.ones(len(slots_t), dtype=self.output_counts.dtype,
                                                                          device=dev), accumulate=True)
        for slot, (spec, _) in fresh.items():
            self._owner[slot] = spec.seq_id

    def _grow(self, num_slots: int, vocab: int, dev: torch.device, dtype: torch.dtype) -> None:
        if self.in_prompt is not None and num_slots <= self.in_prompt.shape[0]:
            return
        old = 0 if self.in_prompt is None else self.in_prompt.shape[0]
        size = max(num_slots, 2 * old)
        in_prompt = torch.zeros((size, vocab), dtype=torch.bool, device=dev)
        counts = torch.zeros((size, vocab), dtype=dtype, device=dev)
        if old:
            in_prompt[:old] = self.in_prompt
            counts[:old] = self.output_counts
        self.in_prompt, self.output_counts = in_prompt, counts
