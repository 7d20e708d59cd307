"""Structured outputs: constraints compiled by xgrammar against the tokenizer's vocabulary, one matcher per
constrained sequence, and each step's allowed-token bitmasks for the sampler.

With a reasoning parser (`EngineConfig.reasoning_parser`) a constraint shapes the answer, not the thinking
before it, as with vLLM: a sequence that begins inside a thinking block draws freely until its closing tag
(`pagedserve.chat.reasoning`), and the grammar begins after it; one that may open a block may start with the
opening tag.

xgrammar over llguidance (benchmarks/grammar_backends.py, figures in benchmarks/RESULTS.md): a step's
mask takes 6-7 us with xgrammar 0.2.8 against 82-90 us with llguidance 1.9.1 on the embedded tokenizer
and a nested schema; llguidance compiles faster (2.7 ms against 7.3 ms), but a compile is cached per
constraint while the mask is paid every step. Masks are made on the engine's side, where the sequences'
tokens are, and travel in the step batch as plain bytes; the workers only apply them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedserve.chat.reasoning import ReasoningStart, ReasoningTags
from pagedserve.sampling_params import StructuredOutputs
from pagedserve.scheduler.batch import StepBatch
from pagedserve.structured_output.lark_grammar import lark_to_ebnf, looks_like_lark

if TYPE_CHECKING:
    from pagedserve.scheduler.request import Sequence

log = logging.getLogger(__name__)

# Compiled grammars kept, least recently used dropped first, bounded by their size: a schema's compiled
# grammar takes ~2 MB on a 49k vocabulary and ~20 MB with a thousand properties, so a bound by count would let
# a few hundred distinct large schemas hold gigabytes.
_CACHE_BYTES = 256 * 2**20


def _lark_as_ebnf(grammar: str) -> str:
    """A grammar in Lark's syntax as xgrammar EBNF (as vLLM takes both); ValueError naming the field and what
    cannot be converted."""
    try:
        return lark_to_ebnf(grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar (Lark syntax), {e}") from None


@dataclass
class _Constrained:
    """A constrained sequence's grammar state."""

    start: ReasoningStart  # where its output begins ("answer" without a reasoning parser)
    begins: int | None = None  # the output index where the grammar begins, once known
    scanned: int = 0  # output tokens searched for the closing tag so far
    matcher: object | None = None
    accepted: int = 0  # output tokens from `begins` on that the matcher has taken


class GrammarManager:
    """Compiles constraints (cached by constraint), keeps a matcher per constrained sequence, fills masks.
    `reasoning`: the engine's reasoning parser and its tags, or None."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 reasoning: ReasoningTags | None = None) -> None:
        self._xgr: Any = None  # xgrammar and its compiler: made on the first compile (reading the vocabulary
        self._compiler: Any = None  # takes a while, and an engine may never see a constrained request)
        self._eos_token_ids = eos_token_ids
        self._compiled: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()  # key -> (grammar, bytes)
        self._compiled_bytes = 0
        # Requests compile on the engine's preparing thread while the step loop may look a grammar up; the
        # compile itself runs outside the lock (xgrammar releases the GIL), so the steps go on meanwhile.
        self._compiled_lock = threading.Lock()
        self._seqs: dict[int, _Constrained] = {}  # by seq_id
        self._broken: set[int] = set()  # sequences whose last token the grammar refused
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._reasoning = reasoning

    def compile(self, constraint: StructuredOutputs) -> object:
        """The compiled grammar (cached); ValueError naming the field when it does not compile."""
        key = constraint.key()
        with self._compiled_lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached[0]
        kind, text = key
        with self._compiled_lock:
            if self._compiler is None:
                self._make_compiler()
        if kind == "grammar" and looks_like_lark(text):
            text = _lark_as_ebnf(text)
        try:
            if kind == "json":
                compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
                compiled = self._compiler.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = self._compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses of its own
            raise ValueError(f"structured_outputs.{kind} does not compile: {str(e).strip()[:300]}") from None
        self._keep(key, compiled, compiled.memory_size_bytes + len(text))
        return compiled

    @property
    def in_use(self) -> bool:
        """Whether any constraint was compiled: until then no sequence is constrained, and a step has no masks."""
        return self._compiler is not None

    def _make_compiler(self) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=list(self._eos_token_ids) or None)
        self._xgr = xgr  # before the compiler: the step loop reads `in_use` from another thread
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _keep(self, key: tuple[str, str], compiled: object, size: int) -> None:
        """Cache a compiled grammar of `size` bytes, dropping the least recently used ones past the bound; one
        larger than the whole bound is not kept (its requests hold it while they run)."""
        if size > _CACHE_BYTES:
            return
        with self._compiled_lock:
            if key in self._compiled:  # compiled twice meanwhile: one copy
                return
            self._compiled[key] = (compiled, size)
            self._compiled_bytes += size
            while self._compiled_bytes > _CACHE_BYTES:
                _, (_, dropped) = self._compiled.popitem(last=False)
                self._compiled_bytes -= dropped

    def _state(self, seq: Sequence) -> _Constrained:
        state = self._seqs.get(seq.seq_id)
        if state is None:
            start: ReasoningStart = "answer"
            if self._reasoning is not None:
                start = self._reasoning.start(seq.request.prompt_token_ids, self._tokenizer.decode)
            state = self._seqs[seq.seq_id] = _Constrained(start)
        return state

    def _begins(self, seq: Sequence, state: _Constrained) -> int | None:
        """Where in the output the grammar begins; None while the sequence is reasoning. Reads the sequence's
        tokens in place: a step copies none of a long reasoning's output."""
        if state.start == "answer":
            state.begins = 0
        if state.begins is not None:
            return state.begins
        tokens, first = seq.token_ids, seq.num_prompt_tokens  # the output is tokens[first:]
        if state.start == "may_open":
            if len(tokens) == first:
                return 0  # for now: the first token may still open a thinking block (`_mask`)
            if tokens[first] != self._reasoning.open_id:
                state.begins = 0
                return 0
        for i in range(first + state.scanned, len(tokens)):
            if tokens[i] == self._reasoning.close_id:
                state.begins = i - first + 1
                break
        state.scanned = len(tokens) - first
        return state.begins

    def _matcher(self, seq: Sequence, state: _Constrained, begins: int) -> object:
        """The sequence's matcher, caught up with its output tokens from `begins` (a fork's child starts its
        own)."""
        if state.matcher is None:
            grammar = seq.request.grammar
            if grammar is None:  # a request not made by `LLMEngine.make_request`
                grammar = self.compile(seq.request.params.structured_outputs)
            state.matcher = self._xgr.GrammarMatcher(grammar)
        tokens, first = seq.token_ids, seq.num_prompt_tokens  # the output is tokens[first:]
        for token in tokens[first + begins + state.accepted:]:  # the new ones only
            # The mask allows only what the matcher accepts, so this is a bug if it happens; should it, the
            # sequence ends here (advance says complete) rather than failing every request of the step.
            if not state.matcher.accept_token(token):
                log.warning("sequence %d: token %d does not fit its grammar; ending it", seq.seq_id, token)
                self._broken.add(seq.seq_id)
                break
        state.accepted = len(tokens) - first - begins
        return state.matcher

    def fill_masks(self, batch: StepBatch, running: list[Sequence]) -> None:
        """Set `token_bitmask` on the batch's constrained samples (all draws of a spec share its state). A
        sequence whose last token is still being drawn by the step in flight (this batch was scheduled ahead)
        gets its mask once that token is known: its sample goes in `batch.late_masks` (`late_masks`)."""
        constrained = [i for i, s in enumerate(batch.samples) if s.params.structured_outputs is not None]
        if not constrained:
            return
        sequences = {seq.seq_id: seq for seq in running}  # only when a step has constrained rows
        for i in constrained:
            spec = batch.samples[i]
            seq = sequences[spec.seq_id]
            if seq.num_pending_tokens > 1:  # this batch's draw, and one in flight before it
                batch.late_masks.append(i)
            else:
                spec.token_bitmask = self._mask(seq)
                if spec.proposals:
                    spec.proposal_bitmasks = self._proposal_masks(seq, spec.proposals)

    def _proposal_masks(self, seq: Sequence, proposals: list[int]) -> list[bytes | None] | None:
        """The masks at each proposal's position past the first: the grammar's after the proposals before it
        (all of which it accepts: `valid_proposals`); None while the sequence reasons."""
        state = self._state(seq)
        begins = self._begins(seq, state)
        if begins is None:
            return None
        matcher = self._matcher(seq, state, begins)
        masks = []
        for token in proposals:
            if not matcher.accept_token(token):
                raise RuntimeError(f"sequence {seq.seq_id}: proposal {token} does not fit its grammar")
            bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V / 32)] int32
            matcher.fill_next_token_bitmask(bitmask, 0)
            masks.append(bitmask.numpy().view(np.uint32).tobytes())
        matcher.rollback(len(proposals))
        return masks

    def valid_proposals(self, seq: Sequence, proposals: list[int]) -> list[int]:
        """The longest prefix of tokens proposed to follow the sequence that its grammar accepts (speculative
        decoding verifies no token the mask would ban). While the sequence reasons, unconstrained, the proposals
        up to the tag that ends its reasoning, after which the grammar would begin."""
        state = self._state(seq)
        begins = self._begins(seq, state)
        if begins is None:
            close = self._reasoning.close_id
            return proposals[:proposals.index(close)] if close in proposals else proposals
        matcher = self._matcher(seq, state, begins)
        if seq.seq_id in self._broken:
            return []
        kept = 0
        for token in proposals:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            kept += 1
        matcher.rollback(kept)
        return proposals[:kept]

    def late_masks(self, batch: StepBatch, seqs: dict[int, Sequence]) -> list[bytes | None]:
        """The masks of `batch.late_masks`, once the step before it has been processed; None for a sequence
        that has ended meanwhile (its draw is discarded) or is still reasoning (its draw is free)."""
        masks: list[bytes | None] = []
        for i in batch.late_masks:
            seq = seqs.get(batch.samples[i].seq_id)
            masks.append(None if seq is None or seq.finished else self._mask(seq))
        return masks

    def _mask(self, seq: Sequence) -> bytes | None:
        """The allowed tokens of the sequence's next draw; None while it is reasoning (no constraint)."""
        state = self._state(seq)
        begins = self._begins(seq, state)
        if begins is None:
            return None
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V / 32)] int32
        self._matcher(seq, state, begins).fill_next_token_bitmask(bitmask, 0)
        words = bitmask.numpy().view(np.uint32)
        if state.start == "may_open" and seq.num_output_tokens == 0:
            open_id = self._reasoning.open_id
            words[0, open_id // 32] |= np.uint32(1 << (open_id % 32))
        return words.tobytes()

    def advance(self, seq: Sequence) -> bool:
        """Take the sequence's new tokens; True when the grammar has reached its end (or cannot go on)."""
        state = self._state(seq)
        begins = self._begins(seq, state)
        if begins is None:
            return False
        return self._matcher(seq, state, begins).is_terminated() or seq.seq_id in self._broken

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._broken.discard(seq_id)
