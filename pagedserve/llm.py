"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import asdict
from typing import Any

from pagedserve.beam_search import BeamSearch
from pagedserve.chat import ChatOptions
from pagedserve.config import EngineConfig
from pagedserve.engine import LLMEngine, Prompt, RequestFailed
from pagedserve.outputs import RequestOutput
from pagedserve.reasoning import split_reasoning
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.request import Request
from pagedserve.tool_calls import ToolCallStream


class LLM:
    """Offline batch API over one `LLMEngine` in this process (its workers too, unless executor="ray")."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs in input order. Validates every prompt before
        starting any, so a bad one raises ValueError and leaves the engine as it was. Logprobs come in vLLM's
        shape: per position a {token id: Logprob} dict (`PositionLogprobs`), prompt logprobs with None first."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, list | tuple)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        engine = self.engine
        requests: list[Request | BeamSearch] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                make = engine.make_beam_search if params.use_beam_search else engine.make_request
                requests.append(make(prompt, params))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        results: list[RequestOutput | None] = [None] * len(requests)
        # Requests running, by id: (the prompt's index, and for a beam search's step, the beam's)
        running: dict[str, tuple[int, int | None]] = {}
        steps: dict[int, list[RequestOutput | None]] = {}  # a beam search's step: its beams' outputs so far

        def start(i: int, request: Request, beam: int | None = None) -> None:
            request.final_output_only = True  # only finished outputs are read below: none is built before
            engine.enqueue(request)
            running[request.request_id] = (i, beam)

        def next_step(i: int, search: BeamSearch) -> None:
            prompts, params = search.step_prompts(), search.step_params()
            steps[i] = [None] * len(prompts)
            for b, ids in enumerate(prompts):
                start(i, engine.make_request(ids, params, f"{search.request_id}#{b}"), b)

        for i, r in enumerate(requests):
            if isinstance(r, BeamSearch):
                next_step(i, r)
            else:
                start(i, r)
        try:
            while running:
                for out in engine.step():
                    if not out.finished or out.request_id not in running:
                        continue
                    i, beam = running.pop(out.request_id)
                    search = requests[i]
                    if beam is None:
                        results[i] = out
                    elif out.error:
                        results[i] = RequestOutput(search.request_id, search.prompt, search.prompt_token_ids,
                                                   finished=True, error=out.error)
                        for rid in [rid for rid, (j, _) in running.items() if j == i]:
                            engine.abort_request(rid)
                            del running[rid]
                    else:
                        steps[i][beam] = out
                        if all(o is not None for o in steps[i]):
                            search.advance(steps.pop(i))
                            if search.done:
                                results[i] = engine.beam_output(search)
                            else:
                                next_step(i, search)
        finally:
            for rid in running:
                engine.abort_request(rid)
        for out in results:
            if out.prompt_logprobs:
                out.prompt_logprobs[0] = None  # vLLM's shape: nothing predicts the first prompt token
        errors = [o.error for o in results if o.error]
        if errors:
            raise RequestFailed(f"{len(errors)} of {len(results)} requests failed: {errors[0]}")
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
        add_special_tokens: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        `tools`, `tool_choice` and `parallel_tool_calls` as OpenAI's; with tools, each output's `tool_calls`
        holds the calls parsed from its text. With a `reasoning_parser`, each output's `reasoning` holds the
        thinking before its answer (its calls are parsed from the answer alone). `add_generation_prompt`,
        `continue_final_message`, `chat_template_kwargs`, `documents` and `add_special_tokens` as vLLM's (see
        `ChatOptions`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = sampling_params if sampling_params is not None else SamplingParams()
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template_kwargs or {}, documents,
                              add_special_tokens)
        plans = []
        for i, conv in enumerate(conversations):
            try:
                plans.append(self.engine.chat_plan(conv, params, tools, tool_choice, parallel_tool_calls, options))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
        outputs = self.generate([p.prompt_token_ids for p in plans], [p.params for p in plans])
        for plan, out in zip(plans, outputs, strict=True):
            for c in out.outputs:
                answer = c.text
                if plan.reasoning is not None:
                    c.reasoning, answer = split_reasoning(plan.reasoning, c.text, final=True)
                if plan.tool_parsing is not None:
                    stream = ToolCallStream(plan.tool_parsing)
                    stream.update(answer, final=True)
                    c.tool_calls = stream.calls
        return outputs

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the worker actors (executor="ray") and release the engine. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def config(self) -> dict[str, Any]:
        return asdict(self.engine.config)
