"""The benchmark scripts' own parts that decide what a GPU run measures, checked where no GPU is."""

from __future__ import annotations

import random

from benchmarks.synthetic_tokenizer import EOS, write_synthetic_tokenizer
from pagedserve.detokenizer import Detokenizer


def test_synthetic_tokenizer_has_the_vocabulary_asked_for(tmp_path):
    from transformers import AutoTokenizer

    eos = write_synthetic_tokenizer(tmp_path, 5000, seed=3)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 5000 and eos == 4999 and tok.eos_token_id == eos and tok.convert_ids_to_tokens(eos) == EOS
    text = "the quick brown fox, 42 times"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(text)
    assert len(ids) < len(text)  # merges apply: words are not spelled out byte by byte
    # Random ids, as a random-weight model draws them, decode to text a piece at a time.
    rng = random.Random(0)
    drawn = [rng.randrange(256, 4999) for _ in range(200)]
    detok = Detokenizer(tok)
    assert tok.clean_up_tokenization_spaces is False  # the Rust decoder's fast path, as for Llama-3 and Qwen2
    for i in range(len(drawn)):
        detok.update(0, drawn[: i + 1], 0, skip_special_tokens=True, stop=[])
    assert detok.text(0) == tok.decode(drawn) and len(detok.text(0)) > 400
