"""The decoder's layers in one native call per step on the CPU (csrc/decoder.c).

At a decode step of a few sequences, the Python and torch dispatch between the CPU kernels (twelve calls a
layer) costs about a third of the step. The driver makes the same kernel calls on the same values in C, so
its outputs are the modules' bits. It takes the models those kernels cover: Llama / Qwen2 / Qwen3 layers (a norm
before each sublayer, SiLU, no soft cap) whose
projections all run on the GGUF-block kernel (`QuantLinear`: GGUF blocks or plain panels; `ConcatQuantLinear`:
parts of different types), fp32, one rank, on
the `cpu` attention backend; the modules
(`CausalLM.forward`) run every other model, and remain the definition of the forward pass.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch

from pagedserve.kernels.backend import AttentionBackend, AttentionContext
from pagedserve.kernels.cpu import ops
from pagedserve.kernels.cpu.native import (
    decoder_library,
    layer_ops_library,
    paged_attention_library,
    quant_linear_library,
)
from pagedserve.kernels.cpu.quant_linear import KERNEL_TYPE, ConcatQuantLinear, QuantLinear

if TYPE_CHECKING:  # the model it runs; at run time only its modules' weights are read
    from pagedserve.workers.models.llama import CausalLM

log = logging.getLogger(__name__)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("quant_linear", "attention", "rms_norm", "rotate", "write_kv", "silu_mul",
                                          "rms_norm_heads", "route")]


_MAX_PARTS = 3  # decoder.c's MAX_PARTS: q, k and v each of its own type at most


class _Part(ctypes.Structure):
    _fields_ = [("panels", _ptr), ("bias", _ptr), ("qtype", _i64), ("n", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _Part * _MAX_PARTS), ("num_parts", _i64), ("k", _i64)]


class _Experts(ctypes.Structure):
    _fields_ = [("gate_up", ctypes.POINTER(_Linear)), ("down", ctypes.POINTER(_Linear)), ("num_experts", _i64),
                ("hidden", _i64), ("intermediate", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("qkv", _Linear),
                ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("router", ctypes.POINTER(_Linear)),
                ("experts", ctypes.POINTER(_Experts)), ("top_k", _i64), ("renormalize", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_q_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("final_norm", _ptr),
                ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _i64), ("num_rows", _i64), ("cu_seqlens_q", _ptr), ("context_lens", _ptr),
                ("block_tables", _ptr), ("slot_mapping", _ptr), ("table_stride", _i64), ("cos", _ptr), ("sin", _ptr),
                ("cos_stride", _i64), ("sin_stride", _i64), ("kv", _ptr), ("num_blocks", _i64), ("block_size", _i64),
                ("num_threads", ctypes.c_int)]


class _Buffers(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("hidden", "residual", "normed", "qkv", "query", "attn", "gate_up", "act",
                                          "router_logits", "route_weights", "route_ids", "moe_scratch", "moe_order")]


def native_forward(model: CausalLM, kv_pool: torch.Tensor, backend: AttentionBackend) -> NativeForward | None:
    """The driver for `model` over `kv_pool` [L, 2, N, B, Hkv, D], or None where it does not cover them (the
    reason logged at debug level)."""
    why = _uncovered(model, kv_pool, backend)
    if why:
        log.debug("the CPU decoder runs layer by layer in Python: %s", why)
        return None
    return NativeForward(model, kv_pool)


def _uncovered(model: CausalLM, kv_pool: torch.Tensor, backend: AttentionBackend) -> str | None:
    config, tp = model.config, model.tp
    if backend.name != "cpu" or (backend.rms_norm, backend.silu_mul, backend.rms_norm_heads, backend.route_topk) != (
            ops.rms_norm, ops.silu_mul, ops.rms_norm_heads, ops.route_topk):
        return f"the {backend.name} attention backend"
    if kv_pool.dtype != torch.float32 or not kv_pool.is_cpu or not kv_pool.is_contiguous():
        return f"a {kv_pool.dtype} KV pool"
    if tp.size != 1:
        return "tensor parallelism"
    if any(window is not None for window in config.layer_windows):
        return "sliding-window layers"  # the one-call forward attends over whole contexts
    if not all(config.rope_layers):
        return "layers without rotary embedding"
    if config.rotary_dim != config.head_dim:
        return "a rotary embedding over part of each head"  # decoder.c rotates whole heads
    if config.family.norms != "pre" or config.family.qk_norm_across_heads:
        # decoder.c has Llama's norms (one before each sublayer) and Qwen3's q/k norms per head
        return f"norms placed {config.family.norms!r} or over all heads"
    if (config.embedding_multiplier, config.residual_multiplier) != (1.0, 1.0):
        return "scaled embeddings or residual adds"  # the logits' scale and cap are applied after it (compute_logits)
    if config.num_experts and (why := _uncovered_experts(model)):
        return why
    if config.hidden_act != "silu":
        return f"a {config.hidden_act} MLP"
    if config.attn_logit_softcapping is not None:
        return "soft-capped attention scores"  # it calls the kernel's entry without a cap
    if None in (decoder_library(), layer_ops_library(), paged_attention_library(), quant_linear_library()):
        return "a kernel that could not be built"
    if not ops.supports_shape(tp.num_heads, tp.num_kv_heads, config.head_dim, kv_pool.shape[3]):
        return "an attention shape the kernel does not take"
    for layer in model.model.layers:
        mlp = ((layer.mlp.gate.linear,) if hasattr(layer.mlp, "experts")
               else (layer.mlp.gate_up_proj, layer.mlp.down_proj))
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *mlp)
        if not all(isinstance(p, QuantLinear | ConcatQuantLinear) for p in projections):
            return "a projection the GGUF-block kernel does not run"
        if any(len(p.columns()) > _MAX_PARTS for p in projections):
            return f"a projection in more than {_MAX_PARTS} parts"
    norms = [model.model.norm.weight] + [norm.weight for layer in model.model.layers for norm in _norms(layer)]
    if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
        return "norm weights that are not contiguous fp32"
    return None


def _uncovered_experts(model: CausalLM) -> str | None:
    """Why the one-call decoder does not take this mixture of experts' layers, or None: it takes routers on the
    kernel (the softmax's top k), and experts in one native call (`attach_native_experts`), without a shared
    expert."""
    for layer in model.model.layers:
        block = layer.mlp
        if not hasattr(block, "experts"):
            continue
        if block.shared_expert is not None:
            return "a shared expert"
        if block.top_k_first:
            return "a router of another kind"
        if block.experts.native is None:
            return "experts the native call does not run"
        if not isinstance(block.gate.linear, QuantLinear) or block.gate.linear.bias is not None:
            return "a router off the linear kernel"
    return None


def _norms(layer) -> list:
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    return norms if layer.self_attn.q_norm is None else [*norms, layer.self_attn.q_norm, layer.self_attn.k_norm]


def _optional_ptr(norm) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _linear(p: QuantLinear | ConcatQuantLinear) -> _Linear:
    bias = None if p.bias is None else p.bias.data_ptr()
    parts = [_Part(part.panels.data_ptr(), None if bias is None else bias + 4 * start, KERNEL_TYPE[part.qtype],
                   part.out_features) for part, start in p.columns()]
    return _Linear((_Part * _MAX_PARTS)(*parts), len(parts), p.in_features)


class NativeForward:
    """`CausalLM.forward`'s hidden states [T, H] from one native call (see the module docstring)."""

    def __init__(self, model: CausalLM, kv_pool: torch.Tensor) -> None:
        config, tp = model.config, model.tp
        self.model = model  # holds every tensor the structures point into
        self.kv_pool = kv_pool
        self.hidden_size = config.hidden_size
        self.qkv_size = (tp.num_heads + 2 * tp.num_kv_heads) * config.head_dim
        self.q_size = tp.num_heads * config.head_dim
        self.intermediate = tp.intermediate_size
        self._moe: list = []
        self.num_experts = self.top_k = self.expert_size = 0  # a MoE model's (any MoE layer's: they are alike)
        layers = model.model.layers
        self._layers = (_Layer * len(layers))(*map(self._layer, layers))
        self._model = _Model(len(layers), config.hidden_size, tp.num_heads, tp.num_kv_heads, config.head_dim,
                             tp.intermediate_size, config.rms_norm_eps, layers[0].self_attn.scale,
                             model.model.norm.weight.data_ptr(), self._layers)
        self._kernels = _kernels()
        self._forward = decoder_library().decoder_forward

    def _layer(self, layer) -> _Layer:
        """A layer's structure; a MoE layer's with its router and its experts' native structure (kept alive here)."""
        attn, block = layer.self_attn, layer.mlp
        common = (layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                  _optional_ptr(attn.q_norm), _optional_ptr(attn.k_norm), _linear(attn.qkv_proj), _linear(attn.o_proj))
        if not hasattr(block, "experts"):
            return _Layer(*common, _linear(block.gate_up_proj), _linear(block.down_proj))
        router = ctypes.pointer(_linear(block.gate.linear))
        self._moe.append((router, block.experts.native))  # what the pointers point into
        self.num_experts, self.top_k = block.experts.num_experts, block.top_k
        self.expert_size = block.experts.native.intermediate
        return _Layer(*common, _Linear(), _Linear(), router, ctypes.pointer(block.experts.native.experts),
                      block.top_k, int(block.renormalize))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, H], the KV pool written as the modules write it."""
        rope = self.model.model.rope
        hidden = self.model.model.embed_tokens(input_ids).contiguous()  # [T, H]; the final norm's output after
        cos, sin = rope.cos_sin(positions, ctx.token_seq_lens, torch.float32)  # [T, 1, D] each
        t = hidden.shape[0]
        # residual and normed [T, H], qkv [T, (Hq + 2 Hkv) D], query and attention out [T, Hq D], gate_up [T, 2 I],
        # act [T, I]: buffers_t's order
        buffers = [torch.empty(t, n) for n in (self.hidden_size, self.hidden_size, self.qkv_size, self.q_size,
                                               self.q_size, 2 * self.intermediate, self.intermediate)]
        # a MoE model's: router logits [T, E], weights and ids [T, k], the experts' scratch and pair order
        pairs = t * self.top_k
        buffers += [torch.empty(t, self.num_experts), torch.empty(t, self.top_k),
                    torch.empty(t, self.top_k, dtype=torch.int64),
                    torch.empty(pairs * (2 * self.hidden_size + 3 * self.expert_size)),
                    torch.empty(pairs, dtype=torch.int64)]
        cu = ctx.cu_seqlens_q.to(torch.int64).contiguous()  # the kernels read int64
        context_lens = ctx.context_lens.to(torch.int64).contiguous()
        tables = ctx.block_tables.to(torch.int64).contiguous()
        slots = ctx.slot_mapping.to(torch.int64).contiguous()
        kv = self.kv_pool
        step = _Step(t, context_lens.shape[0], cu.data_ptr(), context_lens.data_ptr(), tables.data_ptr(),
                     slots.data_ptr(), tables.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), sin.stride(0),
                     kv.data_ptr(), kv.shape[2], kv.shape[3], torch.get_num_threads())
        status = self._forward(ctypes.byref(self._kernels), ctypes.byref(self._model), ctypes.byref(step),
                               ctypes.byref(_Buffers(hidden.data_ptr(), *(b.data_ptr() for b in buffers))))
        if status:
            _raise(status, kv.shape[2], kv.shape[3])
        return hidden


def _kernels() -> _Kernels:
    """The same functions the backend's wrappers call, as pointers."""
    layer_ops = layer_ops_library()
    return _Kernels(*[ctypes.cast(fn, _ptr).value for fn in (
        quant_linear_library().quant_linear, paged_attention_library().paged_attention, layer_ops.rms_norm_f32,
        layer_ops.rotate_qk_f32, layer_ops.write_kv_f32, layer_ops.silu_mul_f32, layer_ops.rms_norm_heads_f32,
        layer_ops.route_topk_f32)])


def attach_native_experts(model: CausalLM) -> int:
    """Give each MoE layer whose experts run on the CPU kernel's layers (SiLU-gated, without biases) their native
    call; returns how many layers got one."""
    attached = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if (experts is None or experts.gate_up_linears is None or experts.activation is not None
                or experts.gate_up_proj_bias is not None
                or not NativeExperts.covers(experts.gate_up_linears, experts.down_linears)):
            continue
        experts.native = NativeExperts(list(experts.gate_up_linears), list(experts.down_linears),
                                       model.config.hidden_size)
        attached += 1
    return attached


class NativeExperts:
    """A MoE layer's SiLU-gated experts, each on the CPU kernel's own layers (`Experts.hold_linears`), in one native
    call (csrc/decoder.c `moe_experts`), where the loop over experts in Python makes about a dozen dispatches an
    expert (one sequence of a Qwen3-MoE-shaped GGUF: 23.7 tokens/s with the loop, 27.2 with this call; see
    benchmarks/RESULTS.md). Its outputs are the modules' bits (`grouped_experts` with the backend's SiLU gate)."""

    def __init__(self, gate_up: list[QuantLinear | ConcatQuantLinear], down: list[QuantLinear], hidden: int) -> None:
        self.layers = (gate_up, down)  # holds the panels the structures point into
        self._gate_up = (_Linear * len(gate_up))(*map(_linear, gate_up))
        self._down = (_Linear * len(down))(*map(_linear, down))
        self.intermediate = down[0].in_features
        self.experts = _Experts(self._gate_up, self._down, len(gate_up), hidden, self.intermediate)
        self._kernels = _kernels()
        self._call = decoder_library().moe_experts

    @staticmethod
    def covers(gate_up: list, down: list) -> bool:
        """Whether these experts' layers are ones the native call runs (kernel layers without biases, in at most
        three parts), and its kernels could be built."""
        layers = [*gate_up, *down]
        return (None not in (decoder_library(), layer_ops_library(), paged_attention_library(), quant_linear_library())
                and all(isinstance(p, QuantLinear | ConcatQuantLinear) and p.bias is None
                        and len(p.columns()) <= _MAX_PARTS for p in layers))

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H] fp32, weights and expert ids [T, k] -> the weighted sum of each token's experts' outputs [T, H]."""
        x = x.contiguous()
        num_tokens, top_k = experts.shape
        ids = experts.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(num_tokens, self.experts.hidden)  # [T, H]
        pairs = num_tokens * top_k
        scratch = torch.empty(pairs * (2 * self.experts.hidden + 3 * self.experts.intermediate))
        order = torch.empty(pairs, dtype=torch.int64)
        status = self._call(ctypes.byref(self._kernels), ctypes.byref(self.experts), x.data_ptr(), num_tokens, top_k,
                            ids.data_ptr(), weights.data_ptr(), out.data_ptr(), scratch.data_ptr(), order.data_ptr(),
                            torch.get_num_threads())
        if status == -1:
            raise IndexError(f"expert ids outside [0, {self.experts.num_experts})")
        if status:
            raise RuntimeError(f"moe_experts: the linear kernel failed with status {-(status + 100)}")
        return out


def _raise(status: int, num_blocks: int, block_size: int) -> None:
    kernel, code = divmod(status, 100)
    if kernel == 2:
        raise IndexError(f"slot_mapping names a slot past the KV pool's {num_blocks * block_size}")
    if kernel == 3 and code == 2:
        raise ValueError(f"block_tables name a block outside the KV pool (num_blocks={num_blocks})")
    if kernel == 4:
        raise IndexError("a route named an expert outside its layer's")
    raise RuntimeError(f"decoder_forward: the {('linear', 'K/V write', 'attention')[kernel - 1]} kernel failed "
                       f"with status {-code}")
