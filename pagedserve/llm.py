"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import asdict
from typing import Any

from pagedserve.chat.reasoning import split_reasoning
from pagedserve.chat.template import ChatOptions
from pagedserve.chat.tool_calls import ToolCallStream
from pagedserve.config import EngineConfig
from pagedserve.engine.beam_search import BeamSearch
from pagedserve.engine.llm_engine import LLMEngine, Prompt
from pagedserve.engine.request_errors import RequestFailed
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.request import Request


class LLM:
    """Offline batch API over one `LLMEngine` in this process (its workers too, unless executor="ray")."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs in input order. Validates every prompt before
        starting any, so a bad one raises ValueError and leaves the engine as it was. Logprobs come in vLLM's
        shape: per position a {token id: Logprob} dict (`PositionLogprobs`), prompt logprobs with None first.
        `lora_request`: the LoRA adapter all prompts run with, or one per prompt (None: the base model's)."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = _per_prompt("sampling_params", sampling_params, len(prompts))
        adapters = _per_prompt("lora_request", lora_request, len(prompts))
        engine = self.llm_engine
        requests: list[Request | BeamSearch] = []
        for i, (prompt, params, adapter) in enumerate(zip(prompts, params_list, adapters, strict=True)):
            try:
                requests.append(engine.inputs.make(prompt, params, lora_request=adapter))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        running = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            for request in requests:
                if isinstance(request, Request):  # only finished outputs are read below: none is built before
                    request.final_output_only = True
                engine.enqueue(request)
            while running:
                for out in engine.step():
                    if out.finished and out.request_id in running:
                        results[running.pop(out.request_id)] = out
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
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        `tools`, `tool_choice` and `parallel_tool_calls` as OpenAI's; with tools, each output's `tool_calls`
        holds the calls parsed from its text. With a `reasoning_parser`, each output's `reasoning` holds the
        thinking before its answer (its calls are parsed from the answer alone). `add_generation_prompt`,
        `continue_final_message`, `chat_template_kwargs`, `documents` and `add_special_tokens` as vLLM's (see
        `ChatOptions`). `lora_request`: the LoRA adapter they run with."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = sampling_params if sampling_params is not None else SamplingParams()
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template_kwargs or {}, documents,
                              add_special_tokens)
        plans = []
        for i, conv in enumerate(conversations):
            try:
                plans.append(self.llm_engine.inputs.chat_plan(conv, params, tools, tool_choice, parallel_tool_calls,
                                                              options))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
        outputs = self.generate([p.prompt_token_ids for p in plans], [p.params for p in plans], lora_request)
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
        return self.llm_engine.stats()

    def shutdown(self) -> None:
        """Stop the worker actors (executor="ray") and release the engine. Idempotent."""
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        # An LLM dropped without shutdown() lets go of its workers, model and KV pool all the same: the engine keeps
        # its start-up heap out of the garbage collector's sight while it runs (`gc.freeze`), so a reference cycle
        # through the engine would otherwise hold them until the process ends.
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def config(self) -> dict[str, Any]:
        return asdict(self.llm_engine.config)


def _per_prompt(name: str, value: Any, count: int) -> list:
    """`value` for each of `count` prompts: a list or tuple gives one each (ValueError naming `name` when its length
    is not `count`), anything else stands for all."""
    values = list(value) if isinstance(value, list | tuple) else [value] * count
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries for {count} prompts")
    return values
