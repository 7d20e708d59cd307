"""Speculative decoding: its settings (`speculative_config.py`), n-gram proposals (`ngram.py`), how many proposals a
step verifies (`policy.py`), and rejection sampling of a draft model's proposals (`verify.py`; the draft runs in
`workers/draft.py`, the verification in `workers/sampler.py`)."""
