"""Kernels: paged KV writes and paged attention (the contract and its backends in `backend.py`), and the
native CPU kernels (`native.py` builds `csrc/`)."""
