"""The CPU's native path, whole: the C kernels (`csrc/`), their build and load on first use (`native.py`), the
`cpu` backend's ctypes wrappers (`ops.py`), the linear layers that run on the C kernel (`quant_linear.py`) or,
without it, on oneDNN's packed weights (`packed_linear.py`), and the decoder's layers in one native call
(`native_forward.py`)."""
