"""Speculative decoding: proposals of the next tokens (`ngram.py`), and their verification against the target
model's distributions, lossless (`verify.py`)."""
