"""gpt-oss checkpoints' expert tensors, read in the layout the MoE block holds.

transformers' `GptOssExperts` stores each layer's experts transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H])
with gate and up interleaved (gate at the even columns, up at the odd ones), biases beside them, and calls its
router `router`. The checkpoints OpenAI published store the two projections in MXFP4 instead: `<name>_blocks`
[E, rows, cols / 32, 16] (two 4-bit e2m1 values a byte, the low nibble first) and `<name>_scales` [E, rows,
cols / 32] (a power of two per 32 values, biased by 127), untransposed (gate_up [E, 2I, H], down [E, H, I]). Both
are given here as the stacked parts the loader places (`experts.gate_proj` [E, I, H], `experts.up_proj`,
`experts.down_proj` [E, H, I], `experts.gate_proj_bias` [E, I], ...), each read as the slice a rank needs; MXFP4
values are dequantized to fp32 (exactly: each is a 4-bit value times a power of two) as they are read.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator

import torch

Reader = Callable[[int, int, int], torch.Tensor]  # read(dim, start, stop): that slice of a tensor

_ROUTER = re.compile(r"(.*\.mlp)\.router\.(weight|bias)$")
_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
# e2m1: the value of each 4-bit code (sign, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] (uint8) and scales [..., G] (uint8) -> fp32 [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: blocks must be "
                         "[..., G, 16] beside scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.flatten(-2)


def expert_tensors(tensors: Iterator[tuple[str, tuple[int, ...], Reader]]
                   ) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """A gpt-oss checkpoint's tensors, the router's and the experts' under the names and layout the loader places
    (the others as they are)."""
    pending: dict[str, torch.Tensor] = {}  # one half of an MXFP4 pair, read whole, until the other arrives
    for name, shape, read in tensors:
        if m := _ROUTER.match(name):
            yield f"{m.group(1)}.gate.{m.group(2)}", shape, read
            continue
        m = _EXPERTS.match(name)
        if m is None:
            yield name, shape, read
            continue
        prefix, proj, kind = m.group(1), m.group(2), m.group(3) or ""
        if kind in ("_blocks", "_scales"):
            pending[name] = read(0, 0, shape[0])
            blocks, scales = pending.get(f"{prefix}.{proj}_blocks"), pending.get(f"{prefix}.{proj}_scales")
            if blocks is not None and scales is not None:
                del pending[f"{prefix}.{proj}_blocks"], pending[f"{prefix}.{proj}_scales"]
                yield from _mxfp4_parts(prefix, proj, blocks, scales)
            continue
        if proj == "down_proj" and not kind:  # [E, I, H] -> [E, H, I]
            yield (f"{prefix}.down_proj", (shape[0], shape[2], shape[1]),
                   functools.partial(_read_transposed, read))
        elif proj == "down_proj":
            yield f"{prefix}.down_proj_bias", shape, read
        else:
            rows = shape[-1] // 2  # gate_up [E, H, 2I] or its bias [E, 2I]
            for which, part in enumerate(("gate_proj", "up_proj")):
                if kind:
                    yield (f"{prefix}.{part}_bias", (shape[0], rows),
                           functools.partial(_read_interleaved, read, which, False))
                else:
                    yield (f"{prefix}.{part}", (shape[0], rows, shape[1]),
                           functools.partial(_read_interleaved, read, which, True))
    if pending:
        raise ValueError(f"MXFP4 tensors without their other half (blocks and scales): {', '.join(sorted(pending))}")


def _read_transposed(read: Reader, dim: int, start: int, stop: int) -> torch.Tensor:
    """down_proj [E, H, I] from the checkpoint's [E, I, H]."""
    return read({0: 0, 1: 2, 2: 1}[dim], start, stop).transpose(1, 2)


def _read_interleaved(read: Reader, which: int, transposed: bool, dim: int, start: int, stop: int) -> torch.Tensor:
    """Columns start .. stop of the gate (which 0) or up (1) part: [E, n, H] from gate_up [E, H, 2I] (transposed),
    or [E, n] from its bias [E, 2I]."""
    if dim != 1:
        raise ValueError("gpt-oss's experts are split along their intermediate dimension only")
    last = 2 if transposed else 1
    part = read(last, 2 * start, 2 * stop)[..., which::2]
    return part.transpose(1, 2) if transposed else part


def _mxfp4_parts(prefix: str, proj: str, blocks: torch.Tensor,
                 scales: torch.Tensor) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """The stacked parts of an MXFP4 projection: gate_up's rows [E, 2I, H] (interleaved) as gate and up, or down
    [E, H, I] as it is."""
    num, rows, cols = blocks.shape[0], blocks.shape[1], blocks.shape[2] * 32
    if proj == "down_proj":
        yield f"{prefix}.down_proj", (num, rows, cols), functools.partial(_read_mxfp4_down, blocks, scales)
        return
    for which, part in enumerate(("gate_proj", "up_proj")):
        yield (f"{prefix}.{part}", (num, rows // 2, cols),
               functools.partial(_read_mxfp4_rows, blocks, scales, which))


def _read_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor, which: int, dim: int, start: int,
                     stop: int) -> torch.Tensor:
    """Rows start .. stop of the gate (which 0) or up (1) part of MXFP4 gate_up [E, 2I, H]."""
    if dim != 1:
        raise ValueError("gpt-oss's experts are split along their intermediate dimension only")
    rows = slice(2 * start, 2 * stop)
    return dequantize_mxfp4(blocks[:, rows], scales[:, rows])[:, which::2]


def _read_mxfp4_down(blocks: torch.Tensor, scales: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """Columns start .. stop (dim 2) of MXFP4 down [E, H, I]: only their groups of 32 dequantized."""
    if dim == 0:
        return dequantize_mxfp4(blocks[start:stop], scales[start:stop])
    if dim != 2:
        raise ValueError("gpt-oss's experts are split along their intermediate dimension only")
    first, last = start // 32, -(-stop // 32)
    values = dequantize_mxfp4(blocks[:, :, first:last], scales[:, :, first:last])
    return values[..., start - first * 32:stop - first * 32]
