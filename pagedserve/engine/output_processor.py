"""Output processing: what a step's new tokens mean for each request, and the outputs callers read. After the
scheduler has taken a step's tokens, a sequence that wrote a stop string or completed its grammar ends here;
outputs are built from a request's sequences (their text decoded, logprob entries named) only when a caller
wants one, so a step whose outputs nobody reads decodes nothing."""

from __future__ import annotations

from pagedserve.engine.beam_search import BeamSearch
from pagedserve.engine.detokenizer import Detokenizer
from pagedserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.scheduler.request import Request, Sequence
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.structured_output.grammars import GrammarManager


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, grammars: GrammarManager | None) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # to finish a sequence that stopped
        self.grammars = grammars
        self.detokenizer = Detokenizer(tokenizer)

    def process(self, updated: list[Sequence]) -> list[Request]:
        """End the sequences of a step that wrote a stop string or completed their grammar; the requests the
        step changed."""
        requests: dict[str, Request] = {}
        for seq in updated:
            params = seq.request.params
            # Text is needed every step only to look for stop strings; without them it is decoded when an
            # output is built, all new tokens at once (`build`), so a step with no output decodes nothing.
            if params.stop:
                self._find_stop_string(seq)
            if params.structured_outputs is not None and self.grammars.advance(seq) and not seq.finished:
                self.scheduler.finish(seq, "stop")  # the grammar is complete: nothing more may follow
            requests[seq.request.request_id] = seq.request
        return list(requests.values())

    def _find_stop_string(self, seq: Sequence) -> None:
        """End the sequence at the first of its new tokens whose text completes a stop string. Several came where
        proposals were kept: those after that token are dropped, as if it had stopped there (whatever ended it
        later is then not what ended it)."""
        params = seq.request.params
        first = seq.num_tokens - seq.num_new_tokens + 1
        for end in range(max(first, seq.num_prompt_tokens + 1), seq.num_tokens + 1):
            # Stop strings count only once min_tokens are out (as EOS and stop_token_ids, banned until then).
            stop = params.stop if end - seq.num_prompt_tokens >= params.min_tokens else []
            tokens = seq.token_ids if end == seq.num_tokens else seq.token_ids[:end]
            hit = self.detokenizer.update(seq.seq_id, tokens, seq.num_prompt_tokens, params.skip_special_tokens,
                                          stop, params.include_stop_str_in_output)
            if hit is None:
                continue
            if end < seq.num_tokens:
                del seq.token_ids[end:]
                del seq.logprobs[end - seq.num_prompt_tokens:]
                if seq.finished:
                    seq.finish_reason, seq.stop_reason = "stop", hit
            if not seq.finished:
                seq.stop_reason = hit
                self.scheduler.finish(seq, "stop")
            return

    def build(self, request: Request) -> RequestOutput:
        """The request's whole output so far; for a finished request, its last (build it once: it frees the
        request's detokenizer and grammar state)."""
        if request.prompt_logprobs is not None:
            self._name_tokens(request.prompt_logprobs)
        with_logprobs = request.params.logprobs is not None
        if with_logprobs:
            for seq in request.sequences:
                self._name_tokens(seq.logprobs)
        skip_special_tokens = request.params.skip_special_tokens
        for seq in request.sequences:  # catch up with tokens not decoded yet (no stop strings: see `process`)
            self.detokenizer.update(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, skip_special_tokens, [])
        outputs = [
            CompletionOutput(
                index=seq.sample_index,
                text=self.detokenizer.text(seq.seq_id),
                token_ids=seq.output_token_ids,  # a fresh slice
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if with_logprobs else None,
            )
            for seq in sorted(request.sequences, key=lambda s: s.sample_index)
        ]
        finished = request.finished
        if finished:
            for seq in request.sequences:
                self.detokenizer.release(seq.seq_id)
                if self.grammars is not None:
                    self.grammars.release(seq.seq_id)
        # The request's prompt ids are never mutated (sequences copy them), so they are shared, not copied.
        prompt_logprobs = list(request.prompt_logprobs) if request.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished,
                             error=request.error, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=request.num_cached_tokens)

    def beam_output(self, search: BeamSearch) -> RequestOutput:
        """A beam search's answer (`BeamSearch.output`), its texts decoded as a request's output is."""
        prompt_ids, skip = search.prompt_token_ids, search.params.skip_special_tokens
        return search.output(lambda ids: self.detokenizer.text_of(prompt_ids + ids, len(prompt_ids), skip))

    def _name_tokens(self, entries: list[PositionLogprobs]) -> None:
        """Give the newest logprob entries (those still without text) their tokens' text."""
        if self.tokenizer is None:
            return
        new: list[PositionLogprobs] = []
        for entry in reversed(entries):
            if entry.token is not None:
                break
            new.append(entry)
        for entry in new:
            for scored, text in zip(entry.values(), self.detokenizer.token_texts(list(entry)), strict=True):
                scored.decoded_token = text
