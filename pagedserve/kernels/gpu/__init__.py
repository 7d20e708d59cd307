"""The Triton kernels, for CUDA (and Triton's interpreter in tests): paged attention (`attention.py`), the K/V write
into the pool (`cache.py`), RMSNorm with the residual add (`norm.py`) and the rotary embedding (`rotary.py`).

Nothing here is imported unless the `triton` backend is picked, so the package imports without Triton."""
