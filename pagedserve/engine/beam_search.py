"""Beam search (`SamplingParams(use_beam_search=True, n=width, length_penalty=...)`), searched as Hugging Face
transformers' `generate(num_beams=width, num_return_sequences=width, length_penalty=...)` searches: the same
candidates, finished hypotheses, length penalty and stopping rule (its default `early_stopping=False`), so
the beams come out the same, best first.

Each step extends every running beam by one token: one request per beam, its prompt the beam's tokens, one
greedy token with the `keep` most likely next tokens' log-probabilities (the model's raw distribution). The
prefix cache holds each beam's blocks, its partial last one as a tail that its step before left
(`BlockPool.cache_tail`), so a step computes one token per beam. `LLMEngine` runs those requests beside the
others (offline and served alike) and hands their outputs to `BeamSearch.advance`; to its callers a search is
one request with one output, its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pagedserve.lora.lora_request import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import MAX_LOGPROBS, SamplingParams

_DROPPED = -1.0e9  # transformers' score for a candidate that may not be chosen

def check_width(width: int, num_eos: int) -> None:
    """ValueError naming n when `width` beams need more candidates a step than a request's logprobs may give;
    `num_eos`: the end-of-sequence token ids a beam may end at (the model's, unless ignore_eos, and
    stop_token_ids). What a beam search cannot honour of the other fields, SamplingParams refuses itself."""
    keep = candidates_per_step(width, num_eos)
    if keep > MAX_LOGPROBS:
        raise ValueError(f"n={width} beams with {num_eos} end-of-sequence token(s) need each beam's {keep} most "
                         f"likely next tokens at every step, more than {MAX_LOGPROBS}: at most "
                         f"n={MAX_LOGPROBS // max(2, 1 + num_eos)}")


def candidates_per_step(width: int, num_eos: int) -> int:
    """Candidates kept per step (transformers' `beams_to_keep`): enough that `width` of them go on even when
    the best ones end."""
    return max(2, 1 + num_eos) * width


@dataclass
class _Finished:
    score: float  # the cumulative log-probability over the output's length ** length_penalty
    tokens: list[int]
    ended: bool  # by an end-of-sequence token (else by max_tokens)
    stop_reason: int | None = None  # the stop_token_ids token it ended at


@dataclass
class BeamSearch:
    """One prompt's search. `step_prompts()` are the token ids to extend by one token; `advance(outputs)` takes
    those requests' outputs (in the same order); when `done`, `output()` is the answer."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int]  # what ends a beam: EOS (unless ignore_eos) and stop_token_ids
    # Output tokens and cumulative log-probability of each running beam, best first. transformers starts
    # `width` copies of the prompt, all but the first at -1e9; only the first can give candidates, so one runs.
    running: list[tuple[list[int], float]] = field(default_factory=lambda: [([], 0.0)])
    finished_beams: list[_Finished] = field(default_factory=list)  # at most `width`, best first
    improvable: bool = True  # transformers' early-stop heuristic: a running beam may still beat a finished one
    done: bool = False
    num_cached_tokens: int | None = None  # of the prompt, at the first step
    # The step running: its requests' ids -> their beams, and the outputs of those that have finished.
    num_steps: int = 0
    step_beams: dict[str, int] = field(default_factory=dict)
    step_outputs: list[RequestOutput | None] = field(default_factory=list)
    aborted: bool = False
    error: str | None = None  # why a failed step ended it
    lora: LoRARequest | None = None  # the adapter its step requests run with

    final_output_only: ClassVar[bool] = True  # a search's callers see its answer alone

    @property
    def finished(self) -> bool:
        return self.done or self.aborted or self.error is not None

    @property
    def num_output_tokens(self) -> int:
        """The answer's tokens, once there is one."""
        return sum(len(f.tokens) for f in self.finished_beams) if self.finished else 0

    def finish_reasons(self) -> list[str]:
        if self.error is not None:
            return ["error"]
        if self.aborted:
            return ["abort"] * self.width
        return ["stop" if f.ended else "length" for f in self.finished_beams]

    @property
    def width(self) -> int:
        return self.params.n

    @property
    def keep(self) -> int:
        """Candidates a step keeps, and so the next tokens each beam's request scores."""
        return candidates_per_step(self.width, len(self.eos_token_ids))

    def step_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.keep, ignore_eos=True,
                              priority=self.params.priority, cache_salt=self.params.cache_salt)

    def step_prompts(self) -> list[list[int]]:
        return [self.prompt_token_ids + tokens for tokens, _ in self.running]

    def start_step(self, request_ids: list[str]) -> None:
        """The next step's requests (one per running beam, as `step_prompts`) are made: wait for them."""
        self.num_steps += 1
        self.step_beams = {rid: b for b, rid in enumerate(request_ids)}
        self.step_outputs = [None] * len(request_ids)

    def take(self, out: RequestOutput) -> bool:
        """A step request's last output; True when the whole step is in, and the search advanced by it (or
        failed with the request's error)."""
        beam = self.step_beams.pop(out.request_id)
        if out.error:
            self.error = out.error
            return True
        self.step_outputs[beam] = out
        if self.step_beams:
            return False
        self.advance(self.step_outputs)
        return True

    def advance(self, outputs: list[RequestOutput]) -> None:
        """One step: the running beams' next-token candidates, from their requests' outputs."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = outputs[0].num_cached_tokens
        keep = self.keep
        length = len(self.running[0][0]) + 1  # output tokens of every candidate
        candidates = []  # (cumulative log-probability, beam, token)
        for b, ((_, cumulative), out) in enumerate(zip(self.running, outputs, strict=True)):
            top = out.outputs[0].logprobs[0].top_logprobs
            candidates += [(cumulative + t.logprob, b, t.token_id) for t in top[:keep]]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:keep]
        ends = [token in self.eos_token_ids or length >= self.max_tokens for _, _, token in candidates]

        # The best `width` candidates that go on run next; a candidate that ended is only taken, at -1e9, when
        # fewer go on (as transformers does).
        beams = [tokens for tokens, _ in self.running]
        going_on = sorted(range(len(candidates)), key=lambda i: -(candidates[i][0] + _DROPPED * ends[i]))
        self.running = [(beams[candidates[i][1]] + [candidates[i][2]], candidates[i][0] + _DROPPED * ends[i])
                        for i in going_on[:self.width]]

        # Of the best `width` candidates, those that ended are hypotheses, kept if among the best `width` yet.
        if self.improvable:
            for (cumulative, b, token), ended in zip(candidates[:self.width], ends, strict=False):
                if ended:
                    stop = token if token in self.params.stop_token_ids else None
                    self.finished_beams.append(_Finished(cumulative / length ** self.params.length_penalty,
                                                   beams[b] + [token], token in self.eos_token_ids, stop))
            self.finished_beams = sorted(self.finished_beams, key=lambda f: -f.score)[:self.width]

        # transformers' heuristic (early_stopping=False): the best running beam, scored at its length now, can
        # still beat the worst of `width` hypotheses (any, while fewer than `width` are found).
        best_running = self.running[0][1] / length ** self.params.length_penalty
        worst = self.finished_beams[-1].score if len(self.finished_beams) == self.width else _DROPPED
        self.improvable = self.improvable and best_running > worst
        self.done = not self.improvable or all(ends)

    def output(self, text_of) -> RequestOutput:
        """The answer: the `width` hypotheses, best first; `text_of(token_ids)` gives an output's text. Aborted:
        the best beams so far, finished ones first, each ended by the abort. Failed: no output, the error."""
        if self.error is not None:
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, finished=True,
                                 error=self.error)
        if self.aborted:
            best = [(f.tokens, "abort", None) for f in self.finished_beams]
            best += [(tokens, "abort", None) for tokens, _ in self.running]
        else:
            best = [(f.tokens, "stop" if f.ended else "length", f.stop_reason) for f in self.finished_beams]
        outputs = [CompletionOutput(index=i, text=text_of(tokens), token_ids=tokens, finish_reason=reason,
                                    stop_reason=stop) for i, (tokens, reason, stop) in enumerate(best[:self.width])]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished=True,
                             num_cached_tokens=self.num_cached_tokens)
