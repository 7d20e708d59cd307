"""The OpenAI response shapes: whole responses and server-sent chunks from a request's deltas, legacy
completions logprobs (with text offsets) and chat logprobs (with bytes), and the error body."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from pagedserve.chat.tool_calls import ToolCallDelta, join_deltas
from pagedserve.outputs import PositionLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.deltas import Delta
from pagedserve.serving.error_status import classify
from pagedserve.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 503: "service_unavailable"}


def error_response(e: Exception) -> JSONResponse:
    err = classify(e)
    return JSONResponse({"error": {"message": err.message, "type": _ERROR_TYPES.get(err.http_status, "server_error"),
                                   "param": err.param, "code": err.http_status}}, status_code=err.http_status)


def _token_bytes(token: str | None) -> list[int] | None:
    return list(token.encode("utf-8", errors="replace")) if token is not None else None


def _token_name(as_ids: bool):
    """How logprobs name a token: its text, or "token_id:<id>" (`return_tokens_as_token_ids`, for tokens
    whose text is not valid UTF-8 alone, such as one byte of a multi-byte character)."""
    return (lambda lp: f"token_id:{lp.token_id}") if as_ids else (lambda lp: lp.token)


class _CompletionLogprobs:
    """The legacy completions `logprobs` object, built token by token (text_offset runs across chunks)."""

    def __init__(self, as_ids: bool, offset: int = 0) -> None:
        self.name = _token_name(as_ids)
        self.offset = offset

    def render(self, entries: list[PositionLogprobs]) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(self.name(e))
            out["token_logprobs"].append(e.logprob)
            # OpenAI's: the chosen token first, then the top k (it once among them); the prompt's first token
            # (echo) has no logprob and no alternatives: nothing predicts it
            out["top_logprobs"].append({self.name(scored): scored.logprob for scored in e.values()}
                                       if e.logprob is not None else None)
            out["text_offset"].append(self.offset)  # offsets into the text, whatever names the tokens
            self.offset += len(e.token or "")
        return out


def _chat_logprobs(entries: list[PositionLogprobs], as_ids: bool) -> dict[str, Any]:
    name = _token_name(as_ids)
    return {"content": [{"token": name(e), "logprob": e.logprob, "bytes": _token_bytes(name(e)),
                         "top_logprobs": [{"token": name(t), "logprob": t.logprob, "bytes": _token_bytes(name(t))}
                                          for t in e.top_logprobs]} for e in entries]}


class ResponseFormatter:
    """One response's OpenAI shape: whole (`whole`) or as server-sent chunks (`sse`). `reasoning`: the engine
    parses a chat's reasoning out of its answer; its messages carry it (unless the request's
    `include_reasoning` is false) as vLLM's `reasoning` and the older `reasoning_content`: clients read
    either. Token ids, as vLLM's `return_token_ids` places them: each choice's `token_ids` (unless it is
    false), and with it true the prompt's, `prompt_token_ids`, on a chat response (its first chunk) or on
    each completion choice (its first chunk).

    A completion of a batch of prompts numbers prompt i's samples from i*n (`merge_prompts`); what belongs
    to a prompt (the text its choices start with under echo, `echoed[i]`, its prompt logprobs and token
    ids, from its first delta) goes with its choices."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, params: SamplingParams,
                 body: CompletionRequest | ChatCompletionRequest, echoed: list[str] | None,
                 reasoning: bool = False) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.parses_reasoning = reasoning
        self.shows_reasoning = reasoning and getattr(body, "include_reasoning", True)
        self.with_logprobs = params.logprobs is not None
        self.tokens_as_ids = bool(body.return_tokens_as_token_ids)
        self.with_token_ids = body.return_token_ids is not False
        self.with_prompt_ids = bool(body.return_token_ids)
        self.with_prompt_logprobs = body.prompt_logprobs is not None
        self.n = params.n
        self.echoed = echoed
        options = body.stream_options
        self.include_usage = options is not None and options.include_usage
        # vLLM's: the usage so far on every chunk is more usage, sent only when usage is asked for at all
        self.continuous_usage = self.include_usage and options.continuous_usage_stats
        self.offsets: dict[int, _CompletionLogprobs] = {}
        # by prompt: from its first delta
        self._prompt_logprobs: dict[int, list[PositionLogprobs] | None] = {}
        self._prompt_ids: dict[int, list[int] | None] = {}

    def _note(self, d: Delta) -> None:
        """What a prompt's first delta carries about the prompt."""
        prompt = d.index // self.n
        if prompt not in self._prompt_ids:
            self._prompt_logprobs[prompt], self._prompt_ids[prompt] = d.prompt_logprobs, d.prompt_token_ids

    def _head(self, d: Delta, first_of_choice: bool) -> tuple[str, list[PositionLogprobs]]:
        """A choice's text and logprob entries, with the echoed prompt before its first chunk."""
        entries: list[PositionLogprobs] = list(d.logprobs)
        text = d.text
        prompt = d.index // self.n
        if first_of_choice and self.echoed is not None:
            text = self.echoed[prompt] + text
            if self.with_logprobs:
                entries = list(self._prompt_logprobs.get(prompt) or []) + entries
        return text, entries

    def _choice_logprobs(self, index: int, entries: list[PositionLogprobs]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        if self.chat:
            return _chat_logprobs(entries, self.tokens_as_ids)
        if index not in self.offsets:
            self.offsets[index] = _CompletionLogprobs(self.tokens_as_ids)
        return self.offsets[index].render(entries)

    def _choice(self, index: int, text: str, token_ids: list[int], entries: list[PositionLogprobs],
                finish_reason: str | None, stop_reason: str | int | None, first: bool, whole: bool,
                tool_calls: list[dict[str, Any]], reasoning: str = "") -> dict[str, Any]:
        """One choice of a response (`whole`) or of a chunk; `first`: the choice's first appearance."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "stop_reason": stop_reason}
        if self.with_token_ids or whole:  # a whole response names every field, null when not asked (vLLM's)
            choice["token_ids"] = token_ids if self.with_token_ids else None
        choice["logprobs"] = self._choice_logprobs(index, entries)
        if not self.chat:
            choice["text"] = text
            prompt = index // self.n
            if first and (self.with_prompt_ids or whole):
                choice["prompt_token_ids"] = self._prompt_ids.get(prompt) if self.with_prompt_ids else None
            # a whole response's choices each carry their prompt's scores (null unasked); a stream's, each
            # prompt's first chunk, when asked
            if whole or (first and index % self.n == 0 and self.with_prompt_logprobs):
                choice["prompt_logprobs"] = self._prompt_logprobs_json(prompt)
        else:
            message: dict[str, Any] = {"role": "assistant"} if first else {}
            # no answer beside calls or reasoning: no content
            message["content"] = text if text or not (tool_calls or self.parses_reasoning) else None
            if self.shows_reasoning and (whole or reasoning):  # a whole message has them, null without reasoning
                message["reasoning"] = message["reasoning_content"] = reasoning or None
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice["message" if whole else "delta"] = message
        return choice

    def _prompt_logprobs_json(self, prompt: int) -> list[dict[str, Any] | None] | None:
        return _prompt_logprobs_json(self._prompt_logprobs.get(prompt)) if self.with_prompt_logprobs else None

    async def whole(self, first: Delta | None, deltas: AsyncIterator[Delta]) -> dict[str, Any]:
        choices: dict[int, dict[str, Any]] = {}
        d = first
        usage: dict[str, int] = {}
        while d is not None:
            self._note(d)
            c = choices.get(d.index)
            if c is None:
                c = choices[d.index] = {"text": "", "entries": [], "token_ids": [], "finish_reason": None,
                                        "stop_reason": None, "tool_calls": [], "reasoning": ""}
                text, entries = self._head(d, True)
            else:
                text, entries = d.text, list(d.logprobs)
            c["text"] += text
            c["reasoning"] += d.reasoning
            c["entries"] += entries
            c["token_ids"] += d.token_ids
            join_deltas(c["tool_calls"], d.tool_calls)
            if d.finish_reason:
                c["finish_reason"], c["stop_reason"] = d.finish_reason, d.stop_reason
            usage = d.usage
            d = await anext(deltas, None)
        out = [self._choice(i, c["text"], c["token_ids"], c["entries"], c["finish_reason"], c["stop_reason"],
                            first=True, whole=True, tool_calls=[{"id": t.id, "type": "function", "function": {
                                "name": t.name, "arguments": t.arguments}} for t in c["tool_calls"]],
                            reasoning=c["reasoning"])
               for i, c in sorted(choices.items())]
        response = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": out, "usage": usage}
        if self.chat:  # a chat's prompt is the response's (vLLM's places), null when not asked
            response["prompt_token_ids"] = self._prompt_ids.get(0) if self.with_prompt_ids else None
            response["prompt_logprobs"] = self._prompt_logprobs_json(0)
        return response

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None, first: bool = False) -> str:
        chunk: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                 "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        if first and self.chat and self.with_prompt_ids:
            chunk["prompt_token_ids"] = self._prompt_ids.get(0)
        if first and self.chat and self.with_prompt_logprobs:
            chunk["prompt_logprobs"] = self._prompt_logprobs_json(0)
        return f"data: {json.dumps(chunk)}\n\n"

    async def sse(self, first: Delta | None, deltas: AsyncIterator[Delta]) -> AsyncIterator[str]:
        started: set[int] = set()
        d = first
        usage: dict[str, int] = {}
        try:
            while d is not None:
                self._note(d)
                new = d.index not in started
                started.add(d.index)
                text, entries = self._head(d, new)
                choice = self._choice(d.index, text, d.token_ids, entries, d.finish_reason, d.stop_reason,
                                      first=new, whole=False, tool_calls=[_tool_call_json(t) for t in d.tool_calls],
                                      reasoning=d.reasoning)
                usage = d.usage
                yield self._chunk([choice], usage if self.continuous_usage else None, first=d is first)
                d = await anext(deltas, None)
            if self.include_usage:
                yield self._chunk([], usage)
        except Exception as e:  # mid-stream: the status line is gone, report in-band as OpenAI does
            err = classify(e)
            yield f"data: {json.dumps({'error': {'message': err.message, 'code': err.http_status}})}\n\n"
        yield "data: [DONE]\n\n"


def _tool_call_json(delta: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's tool call (a chunk's `tool_calls[i]` carries `index`; id, type and name only at first)."""
    out: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        out.update(id=delta.id, type="function", function={"name": delta.name, "arguments": delta.arguments})
    else:
        out["function"] = {"arguments": delta.arguments}
    return out


def _prompt_logprobs_json(entries: list[PositionLogprobs] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} for it, then its top k; None
    for the first token."""
    if entries is None:
        return None
    return [None if e.logprob is None else {
        str(token_id): {"logprob": scored.logprob, "rank": scored.rank, "decoded_token": scored.decoded_token}
        for token_id, scored in e.items()} for e in entries]
