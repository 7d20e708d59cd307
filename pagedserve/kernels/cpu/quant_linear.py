"""Linear layers on the CPU computed from a GGUF checkpoint's own quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
K-types Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_NL, IQ4_XS), and the fp32 layers of any other checkpoint through the same
kernel (plain panels: every row computed the same way in any batch, which oneDNN's GEMM does not; and the model's
layers in one native call, native_forward.py). A bf16 or fp16 checkpoint's weights, widened to fp32 on
load, are held as the 16-bit values they are (BF16, F16 panels): the kernel widens them back to the same floats, so
the model computes the same bits from half the bytes.

A decode step on a CPU is bound by the bytes of weights it streams: fp32 reads 32 bits per weight, these
blocks 2.6 to 8.5. The kernel (csrc/quant_linear.c) multiplies by the weights the GGUF converter
wrote as fp32 (each block's scale factored out of its sum), so it computes the same model. The embedding table
is looked up in panels too (`QuantLinear.rows`: the same floats as the fp32 table), the tied LM head's where it
has one, so no fp32 copy of it is held.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.kernels.cpu.native import quant_linear_library
from pagedserve.kernels.cpu.packed_linear import replace_linears
from pagedserve.workers.models.parallel import shard_range

if TYPE_CHECKING:
    from pagedserve.workers.models.llama import CausalLM


QK = 32  # values per block of the kernel (and of GGUF's Q4_0, Q4_1, Q8_0)
# (values, bytes) of a block of each type the kernel reads: GGUF's types (rows are cut only at their blocks'
# bounds), and plain weights of any checkpoint (read by the same kernel so that every fp32 CPU model computes a
# row the same way in any batch): fp32, or the 16-bit type each weight exactly is.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84),
          "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
          "IQ4_XS": (256, 136), "F32": (32, 128), "BF16": (32, 64), "F16": (32, 64)}
# quant_linear.c's enum; Q5_0 runs as Q8_0 (`q5_0_as_q8_0`)
KERNEL_TYPE = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "F32": 3, "BF16": 4, "F16": 5, "Q4_K": 6, "Q6_K": 7, "Q5_K": 8,
               "Q3_K": 9, "IQ4_NL": 10, "IQ4_XS": 11, "Q2_K": 12, "Q5_1": 13, "Q5_0": 2}
PLAIN_TYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # d = 1: the values themselves
# The per-block fields before the quants (Q5_1's after them), in bytes: fp16 d (and m); Q4_K's and Q5_K's 6-bit
# scale and min of the 32 values, Q6_K's and Q3_K's int8 scales of each 16-value half, Q2_K's 4-bit scale and min of
# each half (a byte), IQ4_XS's int8 scale
_SCALE_FIELDS = {"Q4_0": (2,), "Q4_1": (2, 2), "Q5_0": (2,), "Q5_1": (2, 2), "Q8_0": (2,), "Q2_K": (1, 1),
                 "Q3_K": (1, 1), "Q4_K": (1, 1), "Q5_K": (1, 1), "Q6_K": (1, 1), "IQ4_NL": (2,), "IQ4_XS": (1,)}
# The K-types' fields per 256-value super-block, in the panel's header region: fp16 d (and dmin)
_HEADER_FIELDS = {"Q2_K": (2, 2), "Q3_K": (2,), "Q4_K": (2, 2), "Q5_K": (2, 2), "Q6_K": (2,), "IQ4_XS": (2,)}
_BYTE_QUANTS = ("Q8_0", "Q5_0")  # a byte a quant in the panels
# Quants packed side by side in the panels (Q6_K's and Q3_K's two's complement); the other types' 4-bit quants
# two to a byte
_PACKED_BITS = {"Q2_K": 2, "Q3_K": 3, "Q5_K": 5, "Q5_1": 5, "Q6_K": 6}
# The types whose scale fields follow their quants in a panel's block (quant_linear.c's FIELDS_AT)
_FIELDS_AFTER = ("Q5_1",)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel computes in fp32 on x86 CPUs with AVX2, FMA and F16C."""
    return device.type == "cpu" and dtype == torch.float32 and quant_linear_library() is not None


def _five_bit_quants(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0's or Q5_1's blocks [N, nb, bytes] (uint8) -> their 32 5-bit quants [N, nb, 32] (int32), from the 4 bytes
    of 5th bits at byte `at` and the 16 bytes of low nibbles after them."""
    high = blocks[..., at:at + 4].contiguous().view(torch.int32)  # [N, nb, 1]: value j's 5th bit is bit j
    high = (high >> torch.arange(32, dtype=torch.int32)) & 1  # [N, nb, 32]
    qs = blocks[..., at + 4:]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, nb, 32]: values 0-15 low nibbles, 16-31 high ones
    return low.to(torch.int32) | (high << 4)


def q5_0_as_q8_0(rows: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Q5_0 rows [N, K / 32 * 22] (uint8) -> Q8_0 blocks [N, K / 32 * 34]: the same fp16 d, the 5-bit quants less
    16 as int8. So w = d * q, as gguf's dequantization computes it."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 22)  # [N, nb, 22]: fp16 d, 32 high bits, 16 bytes of low nibbles
    values = (_five_bit_quants(blocks, 2) - 16).to(torch.int8)
    return torch.cat([blocks[..., :2], values.view(torch.uint8)], dim=-1).reshape(n, -1), None


def q5_1_as_blocks_of_32(rows: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Q5_1 rows [N, K / 32 * 24] (uint8) -> blocks [N, K / 32 * 36]: the same fp16 d and m, then the 32 5-bit quants
    a byte each. So w = d * q + m, as gguf's dequantization computes it."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 24)  # [N, nb, 24]: fp16 d, fp16 m, 32 high bits, 16 bytes of low nibbles
    values = _five_bit_quants(blocks, 4).to(torch.uint8)
    return torch.cat([blocks[..., :4], values], dim=-1).reshape(n, -1), None


def _k_scales_and_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's [N, S, bytes] blocks -> each 32 values' 6-bit scale and min [N, K / 32, 1] (uint8), unpacked
    from the block's 12 bytes of scales."""
    n = blocks.shape[0]
    low6, high6, rest = blocks[..., 4:16].reshape(n, -1, 3, 4).unbind(2)  # [N, S, 4] each
    sc = torch.cat([low6 & 0x3F, (rest & 0x0F) | ((low6 >> 2) & 0x30)], dim=-1)  # [N, S, 8] 6-bit scales
    mn = torch.cat([high6 & 0x3F, (rest >> 4) | ((high6 >> 2) & 0x30)], dim=-1)  # [N, S, 8] 6-bit mins
    return sc.reshape(n, -1, 1), mn.reshape(n, -1, 1)


def q4_k_as_blocks_of_32(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K rows [N, K / 256 * 144] (uint8) -> blocks of 32 values [N, K / 32 * 18]: each its sub-block's 6-bit
    scale and min, then its 32 quants as Q4_1 packs them (value j in byte j's low nibble, j + 16 in its high one);
    and each super-block's fp16 d and dmin [N, K / 256 * 4]. So w = (d * sc) * q - dmin * m, as gguf's
    dequantization computes it (the kernel forms d * sc and dmin * m, exact products, in registers)."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 144)  # [N, S, 144]: fp16 d, fp16 dmin, 12 bytes of scales, 128 of quants
    sc, mn = _k_scales_and_mins(blocks)
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # 64 values per 32 bytes: low nibbles, then high ones
    values = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, -1, QK)  # [N, K / 32, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)  # [N, K / 32, 16]
    return torch.cat([sc, mn, packed], dim=-1).reshape(n, -1), blocks[..., :4].reshape(n, -1)


def q5_k_as_blocks_of_32(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K rows [N, K / 256 * 176] (uint8) -> blocks of 32 values [N, K / 32 * 34]: Q4_K's scale and min, then the
    32 5-bit quants a byte each; and each super-block's fp16 d and dmin [N, K / 256 * 4]. So w = (d * sc) * q -
    dmin * m, as gguf's dequantization computes it."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 176)  # [N, S, 176]: as Q4_K's first 16 bytes, 32 of 5th bits, 128 of nibbles
    sc, mn = _k_scales_and_mins(blocks)
    qs = blocks[..., 48:].reshape(n, -1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    low = (qs & 0x0F).reshape(n, -1, 8, 32)  # [N, S, sub-block, 32]: sub-block 2c the low nibbles, 2c + 1 the high
    high = blocks[..., 16:48].reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
    values = (low | ((high & 1) << 4)).reshape(n, -1, QK)  # [N, K / 32, 32]: sub-block j's 5th bits are bit j
    return torch.cat([sc, mn, values], dim=-1).reshape(n, -1), blocks[..., :4].reshape(n, -1)


def q6_k_as_blocks_of_32(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows [N, K / 256 * 210] (uint8) -> blocks of 32 values [N, K / 32 * 34]: the int8 scales of its two
    16-value halves, then its 32 quants less 32, as int8; and each super-block's fp16 d [N, K / 256 * 2]. So
    w = (d * sc) * q, as gguf's dequantization computes it."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 210)  # [N, S, 210]: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 sc, fp16 d
    low = blocks[..., :128].reshape(n, -1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    low = (low & 0x0F).reshape(n, -1, 2, 128)  # [N, S, half, 128]
    high = blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    high = (high & 0x03).reshape(n, -1, 2, 128)
    values = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, -1, QK)  # [N, K / 32, 32]
    scales = blocks[..., 192:208].reshape(n, -1, 2)  # [N, K / 32, 2]: each 32 values' two halves, int8
    return (torch.cat([scales, values.view(torch.uint8)], dim=-1).reshape(n, -1),
            blocks[..., 208:210].reshape(n, -1))


def q3_k_as_blocks_of_32(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K rows [N, K / 256 * 110] (uint8) -> blocks of 32 values [N, K / 32 * 34]: the int8 scales (less 32) of
    its two 16-value halves, then its 32 quants in [-4, 3] as int8; and each super-block's fp16 d [N, K / 256 * 2].
    So w = (d * sc) * q, as gguf's dequantization computes it: Q6_K's form, with 3-bit quants."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 110)  # [N, S, 110]: 32 bytes of high bits, 64 of low 2 bits, 12 of scales, fp16 d
    low = blocks[..., 32:96].reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    low = (low & 3).reshape(n, -1, 8, 32)  # [N, S, 8, 32]: value 32 i + l is row i of 32
    high = blocks[..., :32].reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)  # bit i: row i
    values = (low.to(torch.int8) - (((high & 1) ^ 1) << 2).to(torch.int8)).reshape(n, -1, QK)  # [N, K / 32, 32]
    sc = blocks[..., 96:108]
    low4 = (sc[..., :8].reshape(n, -1, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F
    high2 = (sc[..., 8:].reshape(n, -1, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    scales = (low4.reshape(n, -1, 16) | (high2.reshape(n, -1, 16) << 4)).to(torch.int8) - 32  # [N, S, 16]
    return (torch.cat([scales.reshape(n, -1, 2).view(torch.uint8), values.view(torch.uint8)], dim=-1).reshape(n, -1),
            blocks[..., 108:110].reshape(n, -1))


def q2_k_as_blocks_of_32(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q2_K rows [N, K / 256 * 84] (uint8) -> blocks of 32 values [N, K / 32 * 34]: for each of its two 16-value
    halves the file's byte of a 4-bit scale (low nibble) and a 4-bit min (high), then its 32 2-bit quants a byte
    each; and each super-block's fp16 d and dmin [N, K / 256 * 4]. So w = (d * sc) * q - dmin * m, as gguf's
    dequantization computes it."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 84)  # [N, S, 84]: 16 bytes of scales and mins, 64 of quants, fp16 d and dmin
    qs = blocks[..., 16:80].reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    values = (qs & 3).reshape(n, -1, QK)  # [N, K / 32, 32]: value 32 i + l is (byte l of half i / 4) >> 2 (i % 4)
    sc = blocks[..., :16].reshape(n, -1, 2)  # [N, K / 32, 2]: each half's scale (low nibble) and min (high one)
    return torch.cat([sc, values], dim=-1).reshape(n, -1), blocks[..., 80:84].reshape(n, -1)


def iq4_xs_as_blocks_of_32(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS rows [N, K / 256 * 136] (uint8) -> blocks of 32 values [N, K / 32 * 17]: the int8 scale (less 32) of
    the 32 values, then their 4-bit quants as IQ4_NL packs them; and each super-block's fp16 d [N, K / 256 * 2].
    So w = (d * sc) * v[q] with v IQ4_NL's table of values, as gguf's dequantization computes it."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 136)  # [N, S, 136]: fp16 d, 2 bytes of high scale bits, 4 of low ones, 128 quants
    high = blocks[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [N, S, 1]: scale j's high 2 bits at 2j
    high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # [N, S, 8]
    low = (blocks[..., 4:8].reshape(n, -1, 4, 1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0x0F  # [N, S, 4, 2]
    scales = (low.reshape(n, -1, 8).to(torch.int32) | (high << 4)) - 32  # [N, S, 8]: scale j is low's byte j / 2
    qs = blocks[..., 8:].reshape(n, -1, 8, 16)  # [N, S, 8 blocks of 32, 16 bytes]
    return (torch.cat([scales.to(torch.int8).view(torch.uint8).unsqueeze(-1), qs], dim=-1).reshape(n, -1),
            blocks[..., :2].reshape(n, -1))


# The types the kernel does not read as they are: their rows as blocks of 32 values it does, and the K-types'
# super-block headers
_AS_BLOCKS_OF_32 = {"Q2_K": q2_k_as_blocks_of_32, "Q3_K": q3_k_as_blocks_of_32, "Q4_K": q4_k_as_blocks_of_32,
                    "Q5_K": q5_k_as_blocks_of_32, "Q6_K": q6_k_as_blocks_of_32, "IQ4_XS": iq4_xs_as_blocks_of_32,
                    "Q5_0": q5_0_as_q8_0, "Q5_1": q5_1_as_blocks_of_32}


def repack(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """Rows [N, K / values * bytes] (uint8) of `qtype`'s blocks (`BLOCKS`) -> the kernel's panels of 16 rows [P,
    panel bytes] (see quant_linear.c): per 32-value block the 16 rows' scale fields side by side, then their quants;
    after the blocks, a K-type's super-block headers, the 16 rows' fp16 d (and dmin) side by side."""
    lib = quant_linear_library()
    nr = lib.quant_linear_panel_rows()
    header = None
    if qtype in _AS_BLOCKS_OF_32:
        rows, header = _AS_BLOCKS_OF_32[qtype](rows)
    n = rows.shape[0]
    bb = lib.quant_linear_panel_block_bytes(KERNEL_TYPE[qtype]) // nr  # a row's bytes of 32 values
    if qtype in _PACKED_BITS:  # its quants a byte each until they are packed below
        bb = sum(_SCALE_FIELDS[qtype]) + QK
    nb = rows.shape[1] // bb
    panels = -(-n // nr)
    blocks = torch.zeros(panels * nr, nb, bb, dtype=torch.uint8)  # rows past N: d = m = 0, outputs 0
    blocks[:n] = rows.reshape(n, nb, bb)
    blocks = blocks.view(panels, nr, nb, bb).transpose(1, 2)  # [P, nb, 16 rows, bb]
    if qtype in PLAIN_TYPES:  # [P, nb, 32 k x 16 rows] values, as bytes
        values = blocks.contiguous().view(PLAIN_TYPES[qtype])  # [P, nb, 16 rows, 32 k]
        return values.transpose(2, 3).contiguous().view(torch.uint8).reshape(panels, -1)
    fields = _side_by_side(blocks, _SCALE_FIELDS[qtype])  # each field of the 16 rows side by side: d, then m
    start = sum(_SCALE_FIELDS[qtype])
    if qtype in _BYTE_QUANTS:
        quants = blocks[..., start:].transpose(2, 3).reshape(panels, nb, QK * nr)  # [P, nb, 32 k x 16 rows]
    elif qtype in _PACKED_BITS:
        bits = _PACKED_BITS[qtype]
        values = blocks[..., start:] & ((1 << bits) - 1)  # [P, nb, 16 rows, 32 k]
        quants = _packed(values.transpose(2, 3), bits).reshape(panels, nb, -1)  # [P, nb, 32 k x 2 bits bytes]
    else:
        qs = blocks[..., start:]  # [P, nb, 16 rows, 16 bytes]: value j low nibble, j + 16 high
        values = torch.cat([qs & 0xF, qs >> 4], dim=-1).transpose(2, 3)  # [P, nb, 32 k, 16 rows]
        quants = (values[..., : nr // 2] | (values[..., nr // 2:] << 4)).reshape(panels, nb, QK * nr // 2)
    block = [quants, *fields] if qtype in _FIELDS_AFTER else [*fields, quants]
    parts = [torch.cat(block, dim=-1).reshape(panels, -1)]  # [P, nb * panel block bytes]
    if header is not None:
        hb = sum(_HEADER_FIELDS[qtype])
        padded = torch.zeros(panels * nr, header.shape[1] // hb, hb, dtype=torch.uint8)  # [P * 16, S, hb]
        padded[:n] = header.reshape(n, -1, hb)
        per_panel = padded.view(panels, nr, -1, hb).transpose(1, 2)  # [P, S, 16 rows, hb]
        parts.append(torch.cat(_side_by_side(per_panel, _HEADER_FIELDS[qtype]), dim=-1).reshape(panels, -1))
    return torch.cat(parts, dim=1)


def _packed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`bits`-bit values [..., 16 rows] (uint8) -> [..., 2 * bits] bytes: row r at bits r * bits to r * bits + bits - 1
    (little-endian), each 8 rows in `bits` bytes."""
    rows = values.reshape(*values.shape[:-1], -1, 8)  # [..., 2, 8]
    out = []
    for i in range(bits):  # byte i of 8 rows: their bits 8i to 8i + 7
        byte = torch.zeros_like(rows[..., 0])
        for j in range(8):
            at = bits * j - 8 * i  # where row j's bit 0 falls in byte i (uint8 shifts drop what falls outside)
            if -bits < at < 8:
                byte |= rows[..., j] << at if at >= 0 else rows[..., j] >> -at
        out.append(byte)
    return torch.stack(out, dim=-1).reshape(*values.shape[:-1], -1)


def _side_by_side(fields: torch.Tensor, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """[P, B, 16 rows, bytes] -> each field of `widths` bytes as [P, B, 16 * width]: the 16 rows' values of it side
    by side."""
    out, start = [], 0
    for width in widths:
        out.append(fields[..., start:start + width].reshape(*fields.shape[:2], width * fields.shape[2]))
        start += width
    return out


_REPACK_ROWS = 4096  # rows repacked at a time: a multiple of the panels' 16 rows


def _repacked_in_chunks(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """`repack`, a few thousand rows at a time into the panels' own tensor: the reblocking's temporaries, several
    times a part's bytes, stay those of a chunk (a 1B model's embedding table held them at 0.6 GB at once)."""
    if rows.shape[0] <= _REPACK_ROWS:
        return repack(rows, qtype)
    first = repack(rows[:_REPACK_ROWS], qtype)  # [P, panel bytes]
    per_panel = _REPACK_ROWS // first.shape[0]
    panels = torch.empty(-(-rows.shape[0] // per_panel), *first.shape[1:], dtype=torch.uint8)
    panels[: first.shape[0]] = first
    for start in range(_REPACK_ROWS, rows.shape[0], _REPACK_ROWS):
        part = repack(rows[start:start + _REPACK_ROWS], qtype)
        panels[start // per_panel: start // per_panel + part.shape[0]] = part
    return panels


class _KernelLinear(nn.Module):
    """`x @ W.T + bias` on the kernel, x fp32: W's rows in one or more QuantLinears side by side (`columns`), each
    call writing its own columns of the output."""

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def columns(self) -> list[tuple[QuantLinear, int]]:
        """Each QuantLinear holding W's rows and the first output column it writes."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` without the bias (a row-parallel shard adds it after the all-reduce)."""
        return self._matmul(x, None)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = _input_rows(x, self.in_features)
        y = torch.empty(x2.shape[0], self.out_features)  # [M, N]
        for part, start in self.columns():
            part.write(x2, y.data_ptr() + 4 * start, self.out_features,
                       None if bias is None else bias.data_ptr() + 4 * start)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


def _bias_parameter(bias: torch.Tensor | None) -> nn.Parameter | None:
    """A parameter, so that the loader fills it where the layer is made before the checkpoint is read."""
    return None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)


class QuantLinear(_KernelLinear):
    """`x @ W.T + bias` with W [out_features, in_features] held as GGUF blocks; x is fp32."""

    def __init__(self, rows: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None,
                 panels: torch.Tensor | None = None) -> None:
        """`panels`: `rows` already repacked (`stacked`), which are then read for their shape only."""
        super().__init__()
        if qtype not in BLOCKS:
            raise ValueError(f"GGUF type {qtype!r} has no CPU kernel (supported: {sorted(BLOCKS)})")
        values, block_bytes = BLOCKS[qtype]
        if in_features % values or rows.shape[1] != in_features // values * block_bytes:
            raise ValueError(f"{qtype} rows of {rows.shape[1]} bytes do not hold {in_features} values")
        self.out_features, self.in_features, self.qtype = rows.shape[0], in_features, qtype
        self.panels = _repacked_in_chunks(rows, qtype) if panels is None else panels
        lib = quant_linear_library()
        if self.panels.shape[1] != lib.quant_linear_panel_bytes(KERNEL_TYPE[qtype], in_features):
            raise RuntimeError(f"{qtype} panels of {self.panels.shape[1]} bytes: the kernel reads "
                                 f"{lib.quant_linear_panel_bytes(KERNEL_TYPE[qtype], in_features)}")
        self.bias = _bias_parameter(bias)
        self._kernel, self._lookup = lib.quant_linear, lib.quant_linear_rows  # a step makes a hundred calls

    @classmethod
    def stacked(cls, rows: torch.Tensor, qtype: str, in_features: int) -> list[QuantLinear]:
        """A layer (without bias) for each of rows [E, N, bytes] (a MoE layer's experts), repacked in one pass over
        them all where N is a multiple of the panels' rows: each layer's panels a view of its own rows' (thousands of
        small experts repacked one by one cost ten times their bytes' worth)."""
        num, n = rows.shape[:2]
        if n % quant_linear_library().quant_linear_panel_rows():
            return [cls(r, qtype, in_features, None) for r in rows]
        panels = _repacked_in_chunks(rows.reshape(num * n, -1), qtype)
        return [cls(r, qtype, in_features, None, p) for r, p in zip(rows, panels.view(num, -1, panels.shape[1]),
                                                                     strict=True)]

    @classmethod
    def from_fp32(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        """The layer of fp32 `weight` [out_features, in_features] (in_features a multiple of 32), unquantized:
        held as bf16 or fp16 when every weight is exactly one (a 16-bit checkpoint's), else as fp32."""
        weight = weight.detach().float().contiguous()
        qtype = plain_type(weight)
        rows = weight.to(PLAIN_TYPES[qtype]).view(torch.uint8)  # [N, K * bytes per value]
        return cls(rows, qtype, weight.shape[1], bias)

    def columns(self) -> list[tuple[QuantLinear, int]]:
        return [(self, 0)]

    def write(self, x2: torch.Tensor, y: int, ldy: int, bias: int | None) -> None:
        """`x2 @ W.T (+ bias)` into the fp32 rows at address `y`, `ldy` floats apart (a part's columns of a wider
        output); x2 [M, in_features] as `_input_rows` gives it."""
        if x2.shape[0]:
            status = self._kernel(x2.data_ptr(), x2.shape[0], self.in_features, x2.stride(0), self.panels.data_ptr(),
                                  KERNEL_TYPE[self.qtype], self.out_features, bias, y, ldy, torch.get_num_threads())
            if status:
                raise RuntimeError(f"quant_linear failed with status {status}")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, as the fp32 weights the layer multiplies by: [*ids.shape, in_features]. So an
        embedding table held here is looked up without an fp32 copy of it."""
        flat = ids.reshape(-1).to(torch.long).contiguous()
        out = torch.empty(flat.numel(), self.in_features)  # [T, K]
        status = self._lookup(self.panels.data_ptr(), KERNEL_TYPE[self.qtype], self.out_features, self.in_features,
                              flat.data_ptr(), flat.numel(), out.data_ptr())
        if status == -4:
            bad = flat[(flat < 0) | (flat >= self.out_features)].unique()[:8].tolist()
            raise IndexError(f"ids {bad} are outside the table's {self.out_features} rows")
        if status:
            raise RuntimeError(f"quant_linear_rows failed with status {status}")
        return out.view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"bias={self.bias is not None}")


def _input_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """fp32 CPU `x` [..., in_features] as the kernel reads it: rows [M, in_features] of unit stride."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"QuantLinear takes fp32 CPU inputs, got {x.dtype} on {x.device}")
    if x.shape[-1] != in_features:
        raise ValueError(f"QuantLinear takes inputs of {in_features} features, got {tuple(x.shape)}")
    x2 = x if x.dim() == 2 else x.reshape(-1, in_features)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class ConcatQuantLinear(_KernelLinear):
    """`x @ W.T + bias` where W's rows are QuantLinears of different types side by side: a fused q/k/v or gate/up
    projection whose parts a GGUF holds in different types (llama-quantize's _M mixes give some layers' v_proj
    Q6_K beside a Q4_K q and k). Each part's kernel call writes its own columns of the output, so each streams
    its own blocks, and a column has the bits it has in a layer of its part alone."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1 or any(p.bias is not None for p in parts):
            raise ValueError("the parts of a ConcatQuantLinear take the same inputs and have no bias of their own")
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.bias = _bias_parameter(bias)

    def columns(self) -> list[tuple[QuantLinear, int]]:
        starts = [0]
        for part in self.parts[:-1]:
            starts.append(starts[-1] + part.out_features)
        return list(zip(self.parts, starts, strict=True))


def plain_type(weight: torch.Tensor) -> str:
    """The narrowest plain type that holds every value of fp32 `weight` exactly: "BF16", "F16" or "F32"."""
    for qtype in ("BF16", "F16"):
        if torch.equal(weight.to(PLAIN_TYPES[qtype]).float(), weight):  # a NaN is never equal: fp32 keeps it
            return qtype
    return "F32"


def dequantize(linear: QuantLinear) -> torch.Tensor:
    """The fp32 weights [out_features, in_features] the kernel computes with, read back through the kernel
    itself: row i of `I @ W.T` is column i of W, exactly (every other block adds a zero)."""
    return linear.product(torch.eye(linear.in_features)).T.contiguous()


def load_gguf_linears(model: CausalLM, blocks_path: Path) -> set[str]:
    """Swap each linear layer whose weights `blocks_path` holds as GGUF blocks (the converter's sidecar file) for a
    QuantLinear on this rank's shard of them, and have the embedding looked up in blocks too: the tied LM head's,
    or an untied table's own. Returns the checkpoint tensors now held as blocks, whose fp32 copies the model no
    longer has a place for. A fused layer whose parts differ in type runs each on its own blocks
    (ConcatQuantLinear); one whose shard does not fall on block boundaries keeps its fp32 weights. Runs on a
    loaded model or on one whose parameters are not made yet (on the meta device: `build_model`'s `held_by`),
    which never holds those fp32 copies at all."""
    from safetensors import safe_open

    config, tp = model.config, model.tp
    held: set[str] = set()
    with safe_open(blocks_path, framework="pt") as f:
        types = f.metadata() or {}  # tensor name -> GGUF type
        names = set(f.keys())

        def shard_rows(name: str) -> torch.Tensor | None:
            qtype = types[name]
            rows = f.get_slice(name)
            n, row_bytes = rows.get_shape()
            values, bb = BLOCKS[qtype]
            dim, start, length = shard_range(name, tp, config) or (0, 0, n)
            if dim == 0:
                out = torch.zeros(length, row_bytes, dtype=torch.uint8)  # the last vocabulary shard's padding
                stop = min(start + length, n)
                out[: stop - start] = rows[start:stop]
                return out
            if start % values or length % values:
                return None
            return rows[:, start // values * bb: (start + length) // values * bb].contiguous()

        for owner, attr, parts in _linear_sources(model):
            if not all(p in names and types[p] in BLOCKS for p in parts):
                continue
            shards = [shard_rows(p) for p in parts]
            if any(s is None for s in shards):
                continue
            old = getattr(owner, attr, None)
            in_features = config.hidden_size if old is None else old.in_features
            out_features = tp.vocab_shard if old is None else old.out_features
            if sum(s.shape[0] for s in shards) != out_features:
                raise ValueError(f"{blocks_path}: {', '.join(parts)} hold {sum(s.shape[0] for s in shards)} rows "
                                 f"for this rank, the model expects {out_features}")
            bias = None if old is None else old.bias
            # Neighbouring parts of one type in one layer: one kernel call, not a call a part
            runs = [(qtype, [s for _, s in group]) for qtype, group in
                    itertools.groupby(zip([types[p] for p in parts], shards, strict=True), key=lambda ts: ts[0])]
            if len(runs) == 1:
                layer = QuantLinear(torch.cat(runs[0][1]), runs[0][0], in_features, bias)
            else:
                layer = ConcatQuantLinear([QuantLinear(torch.cat(rows), qtype, in_features, None)
                                           for qtype, rows in runs], bias)
            setattr(owner, attr, layer)
            held.update(parts)
        held |= _gguf_experts(model, f, names, types)
    _table_in_panels(model)
    return held


def _gguf_experts(model: CausalLM, f, names: set[str], types: dict[str, str]) -> set[str]:
    """Each MoE layer's experts on their own GGUF blocks (`experts.{gate,up,down}_proj.weight` [E, rows, bytes]):
    this rank's rows of every expert's gate and up, its columns of down (where they fall on block bounds).
    Returns the names under which the loader meets those tensors, never to read them."""
    tp, held = model.tp, set()
    inter, start = tp.moe_intermediate_size, tp.rank * tp.moe_intermediate_size
    for experts, prefix in _expert_sources(model):
        parts = [f"{prefix}.{proj}_proj.weight" for proj in ("gate", "up", "down")]
        if not all(p in names and types[p] in BLOCKS for p in parts):
            continue
        values, bb = BLOCKS[types[parts[2]]]
        if start % values or inter % values:
            continue  # this rank's columns of down cut its blocks: fp32 experts
        gate, up = (f.get_slice(p)[:, start:start + inter] for p in parts[:2])  # [E, I, bytes]
        down = f.get_slice(parts[2])[:, :, start // values * bb:(start + inter) // values * bb]  # [E, H, bytes]
        hidden = model.config.hidden_size
        if types[parts[0]] == types[parts[1]]:
            gate_up = QuantLinear.stacked(torch.cat([gate, up], dim=1), types[parts[0]], hidden)
        else:
            gate_up = [ConcatQuantLinear([g, u], None) for g, u in zip(
                QuantLinear.stacked(gate.contiguous(), types[parts[0]], hidden),
                QuantLinear.stacked(up.contiguous(), types[parts[1]], hidden), strict=True)]
        experts.hold_linears(gate_up, QuantLinear.stacked(down.contiguous(), types[parts[2]], inter))
        held |= {p.removesuffix(".weight") for p in parts}
    return held


def load_fp32_linears(model: CausalLM) -> int:
    """Swap each nn.Linear whose in_features is a multiple of 32 for a QuantLinear on its fp32 weights, and give
    a tied LM head without a module of its own one on the embedding (the lookup keeps the plain weights); each
    expert of a MoE layer too, its stacked weights dropped (so that its rows, like every other layer's, are
    computed the same way in any batch). Returns how many layers were swapped."""
    swapped = replace_linears(model, lambda weight, bias: QuantLinear.from_fp32(weight, bias)
                              if weight.shape[1] % QK == 0 else None)
    for experts, _ in _expert_sources(model):
        if experts.gate_up_proj is None or experts.gate_up_proj.shape[2] % QK or experts.down_proj.shape[2] % QK:
            continue  # held already (a GGUF's blocks), or widths the kernel does not take
        experts.hold_linears([QuantLinear.from_fp32(w, None) for w in experts.gate_up_proj],
                             [QuantLinear.from_fp32(w, None) for w in experts.down_proj])
        swapped += 2 * experts.num_experts
    for layer in model.model.layers:  # the routers and Qwen2-MoE's shared-expert gates
        for gate in (getattr(layer.mlp, "gate", None), getattr(layer.mlp, "shared_expert_gate", None)):
            if gate is not None and gate.linear is None and gate.weight.shape[1] % QK == 0:
                gate.hold_linear(QuantLinear.from_fp32(gate.weight, gate.bias))
                swapped += 1
    return swapped


def hold_embedding(model: CausalLM) -> str:
    """Look the embedding's rows up in a QuantLinear's panels and drop the fp32 table: in the tied LM head's (the
    same values, held once), in the table's own GGUF blocks (`load_gguf_linears`), else in panels made from it
    (bf16 or fp16 where every value is one). A tied head that reads the table itself keeps it. Returns how the
    table is held."""
    embed, head = model.model.embed_tokens, getattr(model, "lm_head", None)
    if not _table_in_panels(model):
        if model.config.tie_word_embeddings or embed.weight.shape[1] % QK:
            return "F32"  # a tied head that reads the table itself, or a width the kernel does not take
        embed.table = QuantLinear.from_fp32(embed.weight, None)
        embed.weight = None
    return embed.table.qtype + (", the LM head's panels" if embed.table is head else "")


def _table_in_panels(model: CausalLM) -> bool:
    """Where a QuantLinear holds the embedding table's values (the tied LM head, or the table's own blocks), look
    rows up there and drop the fp32 table; whether one does."""
    embed, head = model.model.embed_tokens, getattr(model, "lm_head", None)
    if embed.table is None and model.config.tie_word_embeddings and isinstance(head, QuantLinear):
        embed.table = head
    if embed.table is None:
        return False
    embed.weight = None
    return True


def _expert_sources(model: CausalLM):
    """(experts module, its HF name prefix) of every MoE layer."""
    for i, layer in enumerate(model.model.layers):
        if (experts := getattr(layer.mlp, "experts", None)) is not None:
            yield experts, f"model.layers.{i}.mlp.experts"


def _linear_sources(model: CausalLM):
    """(module, attribute, the HF tensors whose rows it concatenates) for every linear layer."""
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        yield layer.self_attn, "qkv_proj", [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        yield layer.self_attn, "o_proj", [p + "self_attn.o_proj.weight"]
        yield layer.mlp, "gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        yield layer.mlp, "down_proj", [p + "mlp.down_proj.weight"]
        if (shared := getattr(layer.mlp, "shared_expert", None)) is not None:  # Qwen2-MoE's
            yield shared, "gate_up_proj", [p + f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up")]
            yield shared, "down_proj", [p + "mlp.shared_expert.down_proj.weight"]
    # A tied head reads the embedding's blocks, and the lookups read the head's (`hold_embedding`); an untied
    # table has blocks of its own.
    if model.config.tie_word_embeddings:
        yield model, "lm_head", ["model.embed_tokens.weight"]
    else:
        yield model, "lm_head", ["lm_head.weight"]
        yield model.model.embed_tokens, "table", ["model.embed_tokens.weight"]
