"""What a served stream carries: per-sample deltas of a request's cumulative outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.chat.reasoning import ReasoningStart, ReasoningStream
from pagedserve.chat.tool_calls import ToolCallDelta, ToolCallStream, ToolParsing
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams


@dataclass
class Delta:
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict[str, Any] = field(default_factory=dict)  # the request's so far (every delta carries it)
    final: bool = False  # the request's last delta
    prompt_logprobs: list[Logprob] | None = None  # on the request's first delta, when asked for
    # On the request's first delta, when asked for: the prompt as the engine ran it (tokenized, truncated)
    prompt_token_ids: list[int] | None = None
    # With tools in play: the calls' new parts (then `text` is the new content, what is not a call)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # With a reasoning parser: the thinking's new text (then `text` is the answer's)
    reasoning: str = ""


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens found in the prefix cache, not computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_of(u: dict[str, Any]) -> int:
    """The cached prompt tokens of a usage `usage` made (0 in an empty one: a delta made before any came)."""
    return u.get("prompt_tokens_details", {}).get("cached_tokens", 0)


async def stream_deltas(outputs: AsyncIterator[RequestOutput], params: SamplingParams,
                        prompt_ids: bool = False) -> AsyncIterator[Delta]:
    """Per-sample text and token deltas of a request's cumulative outputs. Text that could still turn out
    to be the start of a stop string is held back until it cannot, so streamed text is never taken back.
    `prompt_ids`: the first delta carries the prompt's token ids (else they do not cross to the ingress)."""
    hold = max((len(s) for s in params.stop), default=1) - 1
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    first = True
    async for out in outputs:
        batch = []
        counts = usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                       out.num_cached_tokens or 0)
        for c in out.outputs:
            if c.index in done:
                continue
            finished = c.finish_reason is not None
            t0, k0 = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
            t1 = len(c.text) if finished else max(t0, len(c.text) - hold)
            if t1 == t0 and len(c.token_ids) == k0 and not finished:
                continue
            batch.append(Delta(out.request_id, c.index, c.text[t0:t1], c.token_ids[k0:], (c.logprobs or [])[k0:],
                               c.finish_reason if finished else None, c.stop_reason if finished else None,
                               counts))
            sent_text[c.index], sent_tokens[c.index] = t1, len(c.token_ids)
            if finished:
                done.add(c.index)
        if batch and first:
            batch[0].prompt_logprobs = out.prompt_logprobs
            if prompt_ids:  # the request's own list, never changed: nothing to copy
                batch[0].prompt_token_ids = out.prompt_token_ids
            first = False
        if out.finished and batch:
            batch[-1].final = True
        for d in batch:
            yield d


async def merge_prompts(streams: list[AsyncIterator[Delta]], n: int, request_id: str) -> AsyncIterator[Delta]:
    """The deltas of a batch of prompts, one request each, as one request's, in the order they come: prompt
    i's sample j is choice i*n+j (OpenAI's numbering), and the usage is the batch's so far. Each prompt's
    first delta keeps its prompt's `prompt_logprobs` and `prompt_token_ids`. An error in any prompt ends
    the batch, and every prompt's request with it."""
    queue: asyncio.Queue[tuple[int, Delta | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for d in stream:
                queue.put_nowait((i, d, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    counts = [(0, 0, 0)] * len(streams)  # each prompt's (prompt, completion, cached tokens) so far
    running, ended = len(streams), 0  # ended: prompts whose request's last delta came
    try:
        while running:
            i, d, error = await queue.get()
            if error is not None:
                raise error
            if d is None:
                running -= 1
                continue
            counts[i] = (d.usage.get("prompt_tokens", 0), d.usage.get("completion_tokens", 0), cached_of(d.usage))
            d.request_id, d.index = request_id, i * n + d.index
            d.usage = usage(*(sum(c[k] for c in counts) for k in range(3)))
            ended += d.final
            d.final = ended == len(streams)
            yield d
    finally:
        for task in tasks:
            task.cancel()  # a prompt still running is aborted: its stream's own cleanup frees its blocks
        await asyncio.gather(*tasks, return_exceptions=True)


async def prompt_only(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The deltas with what was generated left out (`CompletionRequest.scores_only`): no text, tokens or
    logprobs, no completion tokens in the usage; each sample ends at its length, zero."""
    try:
        async for d in deltas:
            d.text, d.token_ids, d.logprobs = "", [], []
            d.usage = usage(d.usage.get("prompt_tokens", 0), 0, cached_of(d.usage)) if d.usage else d.usage
            if d.finish_reason is not None:
                d.finish_reason, d.stop_reason = "length", None
            yield d
    finally:
        await deltas.aclose()  # now, not when collected: a client that left ends the request at once


def with_reasoning(deltas: AsyncIterator[Delta], start: ReasoningStart, include: bool = True) -> AsyncIterator[Delta]:
    """The deltas with each sample's text split into reasoning and answer (`pagedserve.chat.reasoning`); without
    `include` (a request's `include_reasoning: false`) the reasoning is left out."""
    def split(d: Delta, stream: ReasoningStream, text: str) -> None:
        reasoning, d.text = stream.update(text, final=d.finish_reason is not None)
        d.reasoning = reasoning if include else ""

    return _split_each_sample(deltas, lambda: ReasoningStream(start), split)


def with_tool_calls(deltas: AsyncIterator[Delta], parsing: ToolParsing) -> AsyncIterator[Delta]:
    """The deltas with each sample's text split into content and tool-call deltas; finish_reason
    "tool_calls" where the model chose to call tools."""
    def split(d: Delta, stream: ToolCallStream, text: str) -> None:
        d.text, d.tool_calls = stream.update(text, final=d.finish_reason is not None)
        d.finish_reason = stream.finish_reason(d.finish_reason)

    return _split_each_sample(deltas, lambda: ToolCallStream(parsing), split)


async def _split_each_sample(deltas: AsyncIterator[Delta], new_stream: Callable[[], Any],
                             split: Callable[[Delta, Any, str], None]) -> AsyncIterator[Delta]:
    """The deltas, each rewritten by `split` from its sample's whole text so far and that sample's parser
    (`new_stream()`, made on the sample's first delta)."""
    texts: dict[int, str] = {}
    streams: dict[int, Any] = {}
    try:
        async for d in deltas:
            if d.index not in streams:
                streams[d.index] = new_stream()
            texts[d.index] = texts.get(d.index, "") + d.text
            split(d, streams[d.index], texts[d.index])
            yield d
    finally:
        await deltas.aclose()  # now, not when collected: a client that left ends the request at once
