"""The Triton kernels, for CUDA (and Triton's interpreter in tests): paged attention (`attention.py`), the K/V write
into the pool (`cache.py`), RMSNorm with the residual add (`norm.py`), the rotary embedding (`rotary.py`) and a
mixture-of-experts layer's experts in two grouped GEMMs (`fused_moe.py`).

Nothing here is imported unless the `triton` backend is picked, so the package imports without Triton."""
