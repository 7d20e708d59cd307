"""Decode steps replayed from CUDA graphs: one launch per step instead of hundreds.

A small model's decode step is a few hundred short kernels; launched one by one from Python, the
launches, not the GPU, set the pace. Decode-only steps (one new token per row) have a shape that
depends on the batch size alone, so the model's forward is captured once per padded batch size
over static input buffers, and a step copies its inputs in and replays the graph.

Padding rows (from the batch's size up to the captured size) write no K/V (slot -1) and have an
empty context; what they compute is never read. The attention kernels are launched with the
maximum context length as their bound, so one graph serves every context length.

With `capture=False` the same static-buffer path runs eagerly: that is how it is tested off-GPU.
"""

from __future__ import annotations

import logging

import torch

from pagedserve.kernels.backend import AttentionBackend, AttentionContext
from pagedserve.workers.models.llama import CausalLM

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Sizes captured: 1, 2, 4, 8, the multiples of 16, and max_num_seqs itself (the largest)."""
    small = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], num_groups: int, backend: AttentionBackend,
                 block_size: int, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches  # per layer: [2, N, B, Hkv, D]
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.capture = capture
        dev = kv_caches[0].device
        max_bs = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)  # [bs]
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)  # [bs]
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.long, device=dev)  # [bs + 1]: one token a row
        self.context_lens = torch.zeros(max_bs, dtype=torch.long, device=dev)  # [bs]
        # Per KV-cache group: slot mapping [bs] and block tables [bs, blocks]
        self.tables = [(torch.full((max_bs,), -1, dtype=torch.long, device=dev),
                        torch.full((max_bs, max_blocks), -1, dtype=torch.long, device=dev)) for _ in range(num_groups)]
        dtype = model.model.norm.weight.dtype  # the activations' (the embedding may be held in panels, not a tensor)
        self.hidden = torch.zeros(max_bs, model.config.hidden_size, dtype=dtype, device=dev)  # [bs, H]
        self.contexts = {bs: AttentionContext(
            backend=backend, slot_mapping=self.tables[0][0][:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            context_lens=self.context_lens[:bs], block_tables=self.tables[0][1][:bs],
            max_query_len=1, max_context_len=max_model_len,
            more_tables=tuple((slots[:bs], tables[:bs]) for slots, tables in self.tables[1:])) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0  # steps served from the static buffers
        self._warm_up_and_capture()

    def can_run(self, ctx: AttentionContext) -> bool:
        """Decode-only steps (every row one new token) of at most the largest captured size, without adapter rows
        (their grouping by adapter is the step's own)."""
        return ctx.max_query_len == 1 and ctx.context_lens.shape[0] <= self.sizes[-1] and ctx.lora is None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The model's hidden states [R, H] for a decode-only step (ctx: the step's own tensors)."""
        num_rows = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= num_rows)
        self.input_ids[:num_rows].copy_(input_ids)
        self.positions[:num_rows].copy_(positions)
        self.context_lens[:num_rows].copy_(ctx.context_lens)
        self.context_lens[num_rows:bs].fill_(0)
        for g, (slot_mapping, block_tables) in enumerate(self.tables):
            step_slots, step_tables = ctx.tables(g)
            slot_mapping[:num_rows].copy_(step_slots)
            slot_mapping[num_rows:bs].fill_(-1)
            width = step_tables.shape[1]  # entries past a row's length are never read: no clearing needed
            block_tables[:num_rows, :width].copy_(step_tables)
        self.num_runs += 1
        if self.capture:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.hidden[:num_rows]

    def _forward(self, bs: int) -> None:
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self.contexts[bs])

    @torch.inference_mode()
    def _warm_up_and_capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        # Largest first: the smaller graphs reuse the memory the largest one's pool already holds.
        for bs in reversed(self.sizes):
            self._forward(bs)  # padding rows only: compiles the Triton kernels outside capture
            if not self.capture:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            self.graphs[bs] = graph
        if self.capture:
            torch.cuda.synchronize()
            log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)
