"""Incremental detokenization: the text built a step at a time is the decode of the output tokens, nothing is
cleaned up a piece at a time, and a character the prompt leaves unfinished goes whole to the output."""

from __future__ import annotations

import random

import pytest

from benchmarks.synthetic_tokenizer import write_synthetic_tokenizer
from pagedserve.engine.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def tokenizers(embedded_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    synthetic = tmp_path_factory.mktemp("synthetic-tokenizer")
    write_synthetic_tokenizer(synthetic, 5000, seed=1)
    return {"smollm2": AutoTokenizer.from_pretrained(embedded_dir),
            "synthetic": AutoTokenizer.from_pretrained(synthetic)}


def token_stream(tok, rng: random.Random, n: int) -> list[int]:
    """Output as a model might draw it: real text, random ids (byte pieces of unfinished characters
    included), multi-byte characters and special tokens."""
    text = tok.encode("Hello, world. naïve café 東京 🙂 — ok", add_special_tokens=False)
    specials = [t for t in tok.all_special_ids if t is not None]
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.3:
            out += text
        elif kind < 0.9:
            out.append(rng.randrange(len(tok)))
        else:
            out.append(rng.choice(specials))
    return out[:n]


def streamed_text(tok, prompt: list[int], output: list[int], skip: bool, rng: random.Random | None = None) -> str:
    """The text decoded a token at a time, or with `rng`, several at a time (as when the engine decodes only
    when it builds an output)."""
    detok = Detokenizer(tok)
    i = 0
    while i < len(output):
        i = min(len(output), i + (rng.randint(1, 8) if rng else 1))
        detok.update(0, prompt + output[:i], len(prompt), skip, stop=[])
    return detok.text(0)


@pytest.mark.parametrize("name", ["smollm2", "synthetic"])
@pytest.mark.parametrize("skip", [True, False])
def test_text_built_a_step_at_a_time_is_the_outputs_decode(tokenizers, name, skip):
    tok = tokenizers[name]
    rng = random.Random(7)
    for _ in range(10):
        output = token_stream(tok, rng, 60)
        # Text waits while its last character is unfinished (one left unfinished mid-output stays U+FFFD).
        done = len(output)
        while tok.backend_tokenizer.decode(output[:done], skip_special_tokens=skip).endswith("\ufffd"):
            done -= 1
        decoded = tok.backend_tokenizer.decode(output[:done], skip_special_tokens=skip)
        assert streamed_text(tok, [], output, skip) == decoded
        assert streamed_text(tok, [], output, skip, rng) == decoded


def test_a_character_the_prompt_leaves_unfinished_goes_whole_to_the_output(tokenizers):
    tok = tokenizers["smollm2"]
    ids = tok.encode("Tokyo is 東京", add_special_tokens=False)
    # Cut where a token leaves 東 or 京 unfinished: the prompt's decode ends in U+FFFD there.
    cuts = [i for i in range(1, len(ids)) if tok.backend_tokenizer.decode(ids[:i]).endswith("\ufffd")]
    assert cuts, "the embedded tokenizer spells these characters in byte pieces"
    for cut in cuts:
        prompt, output = ids[:cut], ids[cut:]
        text = streamed_text(tok, prompt, output, skip=True)
        assert "\ufffd" not in text and text.endswith("京")
        assert tok.backend_tokenizer.decode(ids).endswith(text)


def test_text_is_never_cleaned_up_a_piece_at_a_time(tokenizers):
    """A tokenizer set to clean up tokenization spaces (" ," to ",") lost characters when the clean-up ran
    on each step's window: the text is the plain decode, nothing dropped."""
    tok = tokenizers["synthetic"]
    cleaning = type(tok).from_pretrained(tok.name_or_path, clean_up_tokenization_spaces=True,
                                         clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = cleaning.encode("yes , it is .", add_special_tokens=False)
    assert streamed_text(cleaning, [], ids, skip=True) == "yes , it is ."
