"""Shared fixtures. Tests never reach a model hub, and Triton runs in its interpreter off-GPU."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Must be set before triton is first imported anywhere in the test process.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


import contextlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from tests.tiny_models import tiny_smollm2_config  # noqa: E402


@contextlib.contextmanager
def launched_batches(engine) -> Iterator[list]:
    """Every StepBatch the engine's executor launches inside the block, in launch order."""
    executor = engine.executor
    batches: list = []
    launch = executor.launch
    executor.launch = lambda batch: batches.append(batch) or launch(batch)
    try:
        yield batches
    finally:
        del executor.launch


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2, converted from its GGUF once (cached under ~/.cache/pagedserve)."""
    from pagedserve.workers.loader import resolve_model

    return resolve_model(None).weights_dir


@pytest.fixture(scope="session")
def tiny_random(tmp_path_factory, embedded_dir) -> str:
    """`random:<config.json>` for a 2-layer Llama that shares SmolLM2's vocabulary and tokenizer. Its chat
    template is SmolLM2's with Qwen3's switch for an empty thinking block after the generation prompt
    (`enable_thinking`), a variable requests may set, and a system turn listing `documents` first, as
    templates for retrieval-augmented generation do: with neither, it renders as SmolLM2's."""
    d = tmp_path_factory.mktemp("tiny_random")
    config = tiny_smollm2_config(d, embedded_dir)
    template = d / "chat_template.jinja"
    template.write_text(DOCUMENTS + template.read_text() + THINKING_OFF)
    return f"random:{config}"


@pytest.fixture(scope="session")
def thinking_random(tmp_path_factory, tiny_random) -> str:
    """`tiny_random` as a reasoning model: `<think>` and `</think>` are tokens of their own (ids 49152 and
    49153, kept in the text, as Qwen3's), and the template's `thinking` variable opens a thinking block after
    the generation prompt (as Qwen3-Thinking's and DeepSeek-R1's templates do)."""
    from tokenizers import AddedToken, Tokenizer

    d = tmp_path_factory.mktemp("thinking_random")
    shutil.copytree(tiny_random.removeprefix("random:").rsplit("/", 1)[0], d, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    tokenizer.save(str(d / "tokenizer.json"))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, vocab_size=config["vocab_size"] + 2)))
    template = d / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING_ON)
    return f"random:{d / 'config.json'}"


DOCUMENTS = ("{% if documents %}{{ '<|im_start|>system\nDocuments:\n' }}{% for d in documents %}"
             "{{ d.title ~ ': ' ~ d.text ~ '\n' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}")
THINKING_OFF = ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                "{{ '<think>\n\n</think>\n\n' }}{% endif %}")
THINKING_ON = ("{% if add_generation_prompt and thinking is defined and thinking %}{{ '<think>\n' }}{% endif %}")
