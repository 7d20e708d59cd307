"""A byte-level BPE tokenizer of any vocabulary size, built offline, for random-weight benchmark models.

A random checkpoint has no tokenizer, so an engine serving it would skip detokenization, which is real
host work per token in serving. This builds one of the model's vocabulary size with the same machinery
as Llama-3's and Qwen2's (byte-level BPE through `tokenizers`): the 256 byte tokens, then merges of two
earlier tokens into words of 2-10 letters, mostly lowercase ASCII, some with a leading space (as in real
vocabularies), and one end-of-text token last. Decoding any id sequence gives valid UTF-8 except where a
lone byte token above 0x7f lands, as with a real tokenizer fed random ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"


def write_synthetic_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> int:
    """Write tokenizer.json and tokenizer_config.json of `vocab_size` ids into `out_dir`; the eos token's id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    if vocab_size < 258:
        raise ValueError(f"vocab_size={vocab_size} must be at least 258 (256 bytes, a merge, end-of-text)")
    byte_chars = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes that byte-level BPE uses
    space = next(c for c in byte_chars if c == "Ġ")
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [c for c in letters]  # tokens that merges extend
    while len(vocab) < vocab_size - 1:
        left = rng.choice(words)
        right = rng.choice(letters) if rng.random() < 0.7 else rng.choice(words)
        if rng.random() < 0.15 and not left.startswith(space):
            left, right = space, left  # " word": a token that starts a word
        token = left + right
        if token in vocab or len(token) > 10:
            continue
        vocab[token] = len(vocab)
        merges.append((left, right))
        words.append(token)
    vocab[EOS] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "clean_up_tokenization_spaces": False}))
    return vocab[EOS]
