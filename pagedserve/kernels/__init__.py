"""Kernels: paged KV writes and paged attention, with the layer's small ops beside them.

`backend.py` is the contract and picks a backend; `reference.py` is plain torch (the oracle and the fallback);
`gpu/` holds the Triton kernels, `cpu/` the C kernels and everything that calls them."""
