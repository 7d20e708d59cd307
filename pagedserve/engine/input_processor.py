"""Input processing: a request made ready to run before it reaches the scheduler. Prompts tokenized and
checked, chat templates rendered (tools offered, the oldest turns dropped to fit), reasoning tags found,
grammars compiled, beam searches started; every error a ValueError naming the field.

It reads only what does not change while the engine steps (the tokenizer, the model's and the pool's limits)
and the grammar cache (locked), so a served engine runs it on a thread beside the step loop
(`AsyncEngine.prepare`)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from pagedserve.chat.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningStart, ReasoningTags
from pagedserve.chat.template import ChatOptions, ChatPlan, ChatTemplate
from pagedserve.chat.tool_calls import Tool, parse_tool_choice, parse_tools
from pagedserve.chat.tool_calls import plan as plan_tool_calls
from pagedserve.engine.beam_search import BeamSearch, check_width
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.lora.registry import AdapterRegistry
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.structured_output.grammars import GrammarManager
from pagedserve.workers.models.model_config import ModelConfig

# A text, token ids, or vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}
Prompt = str | list[int] | dict[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_of(prompt: Prompt) -> str | list[int]:
    """The text or token ids a prompt holds (vLLM's dicts unwrapped); ValueError naming a key that cannot
    be honoured (multimodal data: this server serves text)."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt has keys {unknown} that are not supported (a prompt dict holds one of "
                         f"{', '.join(_PROMPT_KEYS)})")
    if len(prompt) != 1:
        raise ValueError(f"prompt: give one of {', '.join(_PROMPT_KEYS)}, not {len(prompt)}")
    (key, value), = prompt.items()
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt.prompt must be a string, got {type(value).__name__}")
    if key == "prompt_token_ids" and not isinstance(value, list | tuple):
        raise ValueError(f"prompt.prompt_token_ids must be a list of token ids, got {type(value).__name__}")
    return value


class InputProcessor:
    """Makes requests (`make`) and chat prompts (`chat_plan`) for one model; `tokenize` / `detokenize` too."""

    def __init__(self, model_config: ModelConfig, tokenizer, eos_token_ids: tuple[int, ...],
                 reasoning: ReasoningTags | None, scheduler: Scheduler, adapters: AdapterRegistry) -> None:
        self.model_config = model_config
        self.adapters = adapters  # the LoRA adapters a request may name, checked before it is queued
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler  # its limits: the room a prompt has, whether a request can ever run
        self.reasoning_tags = reasoning
        self.grammars = GrammarManager(tokenizer, model_config.vocab_size, eos_token_ids,
                                       self.reasoning_tags) if tokenizer is not None else None
        self._template: ChatTemplate | None = None  # made on the first chat request
        self._ids = itertools.count()

    def make(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
             lora_request: LoRARequest | None = None) -> Request | BeamSearch:
        """A request, or a beam search when `params.use_beam_search`: validated, nothing added. `lora_request`: the
        adapter it runs with (None: the base model)."""
        make = self.make_beam_search if getattr(params, "use_beam_search", False) else self.make_request
        return make(prompt, params, request_id, lora_request)

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate and tokenize; raises ValueError naming the bad field. Adds nothing."""
        check_params(params)
        params.validate()
        if lora_request is not None:
            self.adapters.check(lora_request)
        if params.use_beam_search:
            raise ValueError("use_beam_search: a beam search runs as requests of its own (make_beam_search, or "
                             "make: the engine runs it)")
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name}: words need a tokenizer, and this model has none (name tokens by id: "
                                 "stop_token_ids, logit_bias)")
        prompt = prompt_of(prompt)
        token_ids = self.encode_prompt(prompt)
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.scheduler.prompt_room(params.max_tokens)
            if keep < 1:
                raise ValueError(f"max_tokens={params.max_tokens} leaves no room for a prompt in a context of "
                                 f"{keep + (params.max_tokens or 1)} tokens (truncate_prompt_tokens=-1)")
        if keep is not None:
            token_ids = token_ids[-keep:]
        for name, ids in params.token_ids_named().items():
            self.check_token_ids(name, ids)
        constraint = params.structured_outputs  # compiled now: a ValueError here, not mid-generation
        grammar = self.compile(constraint) if constraint is not None else None
        bad_words = self.bad_words_token_ids(params.bad_words)
        if params.allowed_token_ids is not None and {ids[0] for ids in bad_words if len(ids) == 1}.issuperset(
                params.allowed_token_ids):
            raise ValueError("bad_words ban every token of allowed_token_ids: nothing would be left to draw")
        request_id = str(next(self._ids)) if request_id is None else request_id
        request = Request(request_id, token_ids, params, frozenset(self.eos_token_ids),
                          prompt=prompt if isinstance(prompt, str) else None, bad_words_token_ids=bad_words,
                          grammar=grammar, lora=lora_request)
        self.scheduler.check_admissible(request)
        return request

    def make_beam_search(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                         lora_request: LoRARequest | None = None) -> BeamSearch:
        """A beam search's start (`params.use_beam_search`), validated as `make_request` validates a request:
        the prompt tokenized and cut as truncate_prompt_tokens says, and checked to fit with max_tokens.
        ValueError naming the field."""
        check_params(params)
        params.validate()
        ends = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids)
        check_width(params.n, len(ends))
        first = self.make_request(prompt, dataclasses.replace(params, n=1, use_beam_search=False, length_penalty=1.0),
                                  request_id, lora_request)
        prompt_ids = first.prompt_token_ids
        room = self.scheduler.prompt_room(None) + 1 - len(prompt_ids)  # the context left for the output
        return BeamSearch(first.request_id, first.prompt, prompt_ids, params, params.max_tokens or room, ends,
                          lora=lora_request)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the token sequences that spell it: alone, and after a space (mid-text, where a
        tokenizer folds the space into the word's first token), as vLLM tokenizes them."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text through the tokenizer, ids checked against the vocabulary. ValueError
        naming what is wrong."""
        prompt = prompt_of(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("prompt is text but this model has no tokenizer: pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            token_ids = list(prompt)
            self.check_token_ids("prompt_token_ids", token_ids)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        return token_ids

    def reasoning_start(self, prompt_token_ids: list[int]) -> ReasoningStart | None:
        """Where a sample of the prompt begins (see `pagedserve.chat.reasoning`); None without a reasoning parser."""
        if self.reasoning_tags is None:
            return None
        return self.reasoning_tags.start(prompt_token_ids, self.tokenizer.decode)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: ChatOptions | None = None) -> list[int]:
        """The model's chat template applied to `messages` (and `tools`, OpenAI's shapes), as token ids;
        ValueError naming what is wrong."""
        return self.chat_template().render(messages, parse_tools(tools), options)

    def chat_plan(self, messages: list[dict[str, Any]], params: SamplingParams,
                  tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                  parallel_tool_calls: bool | None = None, options: ChatOptions | None = None) -> ChatPlan:
        """A chat request made ready to run: its prompt with the tools offered, `params` with the output
        constraint that `tool_choice` "required" or a named function asks for, and how to parse its tool
        calls. ValueError naming the field that is wrong."""
        check_params(params)
        template = self.chat_template()
        offered = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, offered)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls={parallel_tool_calls!r} must be true or false")
        constraint, parsing = plan_tool_calls(offered, choice, parallel_tool_calls, template.tool_format)
        if constraint is not None:
            named = repr(choice.function) if choice.function else "'required'"
            if params.use_beam_search:
                raise ValueError(f"tool_choice={named} constrains the output: it cannot be combined with "
                                 "use_beam_search (a beam search is not constrained by a grammar here)")
            try:
                self.compile(constraint)
            except ValueError as e:
                raise ValueError(f"tools: the parameters schema of tool_choice={named} does not compile: "
                                 f"{str(e).split(': ', 1)[-1]}") from None
            # A forced call writes no message text, so a response format has nothing to shape: the call's
            # constraint replaces it for this request (as OpenAI and vLLM accept the pair)
            params = dataclasses.replace(params, structured_outputs=constraint)
        shown = offered if choice.mode != "none" else []  # "none": the model is not told of tools it may not call
        ids = template.render(messages, shown, options)
        if params.truncate_prompt_tokens == -1:
            ids, params = self._drop_oldest_turns(template, messages, shown, options, ids, params)
        tags = self.reasoning_tags
        return ChatPlan(ids, params, parsing, self.reasoning_start(ids), tags.close_id if tags else None)

    def _drop_oldest_turns(self, template: ChatTemplate, messages: list[dict[str, Any]], tools: list[Tool],
                           options: ChatOptions | None, ids: list[int],
                           params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """A chat's `truncate_prompt_tokens=-1`: the oldest turns after the leading system messages dropped,
        whole (a user message with its answer, calls and their results), until the prompt leaves room for
        max_tokens, as OpenAI's `truncation: "auto"` drops items; cutting the rendered prompt's first tokens
        instead would cut into the template's own. The last message is never dropped: a prompt still too long
        is refused."""
        room = self.scheduler.prompt_room(params.max_tokens)
        params = dataclasses.replace(params, truncate_prompt_tokens=None)
        if len(ids) <= room:
            return ids, params
        first = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")),
                     len(messages))
        # Where the kept conversation may start: at a later user message (whole turns dropped before it), or
        # at the last message. Fewer messages never render longer, so the earliest start that fits is found
        # by bisection: a long conversation is rendered a few times, not once per turn.
        starts = sorted({i for i in range(first + 1, len(messages)) if messages[i].get("role") == "user"}
                        | ({len(messages) - 1} if first < len(messages) - 1 else set()))
        lo, hi, fits = 0, len(starts), None
        while lo < hi:
            mid = (lo + hi) // 2
            tried = template.render(messages[:first] + messages[starts[mid]:], tools, options)
            if len(tried) <= room:
                hi, fits = mid, tried
            else:
                lo = mid + 1
        if fits is None and starts:  # not even the last message fits: its prompt, refused when it is run
            fits = template.render(messages[:first] + messages[starts[-1]:], tools, options)
        return (ids if fits is None else fits), params

    def chat_template(self) -> ChatTemplate:
        """The model's chat template (made on first use); ValueError naming messages if it has none."""
        if self._template is None:
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("messages: this model has no chat template")
            self._template = ChatTemplate(self.tokenizer)
        return self._template

    def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                 add_special_tokens: bool | None = None, tools: list[dict[str, Any]] | None = None,
                 options: ChatOptions | None = None) -> tuple[list[int], list[str]]:
        """Token ids and their string forms of `text`, or of `messages` (and `tools`, rendered as `options`
        say) through the chat template. `add_special_tokens` unset: true for text, as `options` say for
        messages (false by default: the template writes them)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        if messages:
            if add_special_tokens:
                options = dataclasses.replace(options or ChatOptions(), add_special_tokens=True)
            ids = self.chat_prompt(messages, tools, options)
        elif chat_only := (["tools"] if tools else []) + (options.changed() if options is not None else []):
            raise ValueError(f"{', '.join(chat_only)}: these shape a chat's prompt: give them with messages, "
                             "not with text")
        elif text:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens is not False)
        else:
            raise ValueError("text is empty (give text or messages)")
        return ids, self.tokenizer.convert_ids_to_tokens(ids)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens included); ValueError for an id outside the vocabulary."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        self.check_token_ids("tokens", token_ids)
        return self.tokenizer.decode(token_ids)

    def check_token_ids(self, name: str, token_ids: list[int]) -> None:
        """ValueError naming `name` if any of `token_ids` is not a token id of this model."""
        vocab = self.model_config.vocab_size
        outside = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if outside:
            raise ValueError(f"{name} contains {outside[:5]!r}, outside the vocabulary [0, {vocab})")

    def compile(self, constraint) -> object:
        """The constraint's compiled grammar (cached); ValueError naming the field when it does not compile."""
        if self.grammars is None:
            raise ValueError("structured_outputs need a tokenizer; this model has none")
        return self.grammars.compile(constraint)


def reasoning_tags(parser: str | None, tokenizer, vocab_size: int) -> ReasoningTags | None:
    """The reasoning parser and the token ids of `<think>` and `</think>`, when one is set; ValueError
    naming it if this model's tokenizer does not write them as tokens of their own that its text keeps."""
    if parser is None:
        return None
    if tokenizer is None:
        raise ValueError(f"reasoning_parser={parser!r} needs a tokenizer, and this model has none")
    ids = []
    for tag in (THINK_OPEN, THINK_CLOSE):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1 or encoded[0] >= vocab_size:
            raise ValueError(f"reasoning_parser={parser!r} is for models that write their reasoning between "
                             f"{THINK_OPEN} and {THINK_CLOSE} tokens; this model's tokenizer has no {tag} token")
        if encoded[0] in tokenizer.all_special_ids:
            raise ValueError(f"reasoning_parser={parser!r}: this model's tokenizer counts {tag} as a special "
                             "token, which outputs drop from their text (skip_special_tokens)")
        ids.append(encoded[0])
    return ReasoningTags(parser, *ids)


def check_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
