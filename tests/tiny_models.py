"""Tiny random-weight checkpoints for tests and benchmarks that need many short requests rather than a real model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def tiny_smollm2_config(directory: Path, embedded: Path) -> Path:
    """A 2-layer Llama's config.json in `directory`, sharing SmolLM2's vocabulary and tokenizer (its files copied
    from the embedded model's directory `embedded`): `random:<the path>` loads it with random weights."""
    config = json.loads((embedded / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    config.pop("head_dim", None)
    (directory / "config.json").write_text(json.dumps(config))
    for f in embedded.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, directory / f.name)
    return directory / "config.json"
