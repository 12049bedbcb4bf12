"""The CPU backend: decode rows through the paged kernel, prefill chunks through torch SDPA.

The kernel (`workers.kernels`) reads each decode sequence's K/V from its blocks in place, once,
for all its heads; torch SDPA over the same rows has to gather the blocks into a padded copy
first and runs many small products below the memory's rate. In a step where every row decodes,
the kernel also stores the new K/V rows and reads q, k and v as views of the fused projection's
output, so a layer's attention is one call. Prefill chunks carry many query rows, where SDPA's
kernel is already efficient, so they keep the torch backend's path. How the kernel reads K/V
(rows asked for ahead and how, how scores are computed, V rows per pass) is measured per dtype
(`attention.kv_reads`); where the fastest reads K laid out in pairs (`attention.k_pairs`), and
on AMX tiles V in pairs of positions (`attention.v_pairs`), this backend stores and gathers them
in that order (`attention.layouts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from prefixserve.workers.attention import k_pairs, v_pairs
from prefixserve.workers.attention.base import AttentionBackend
from prefixserve.workers.attention.kv_reads import AMX_V_PAIRS, PAIRED, SCORES, KVReads, kv_reads
from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.attention.torch_sdpa import (
    Prefill,
    TorchSDPABackend,
    prefill_into,
    prefill_plans,
    store_rows,
)


@dataclass
class PagedPlan:
    rows: torch.Tensor | None  # flat rows of the decode sequences; None: every row, in order
    tables: torch.Tensor  # [n, width] their block tables
    lens: torch.Tensor  # [n] their context lengths
    prefills: list[Prefill]
    layout: str  # the order of K and V within a block (`CPUPagedBackend.kv_layout`)

    @classmethod
    def make(cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype,
             layout: str) -> PagedPlan:
        q_lens, _ = meta.host_lens()
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        if len(decode) == len(q_lens):
            return cls(None, meta.block_tables, meta.context_lens, [], layout)
        idx = torch.tensor(decode, dtype=torch.long, device=meta.slot_mapping.device)
        rows = meta.query_start_loc.index_select(0, idx)
        return cls(rows, meta.block_tables.index_select(0, idx).contiguous(),
                   meta.context_lens.index_select(0, idx),
                   prefill_plans(meta, block_size, dtype), layout)


class CPUPagedBackend(AttentionBackend):
    """Paged decode in one kernel call per layer; SDPA for the shapes the kernel does not take."""

    name = "cpu_paged"

    def __init__(self, kernel: ModuleType) -> None:
        self.kernel = kernel
        self.fallback = TorchSDPABackend()
        self.reads: dict[torch.dtype, KVReads] = {}  # how the kernel reads K/V, per dtype

    def prepare(self, dtype: torch.dtype) -> None:
        if dtype not in self.reads:
            self.reads[dtype] = kv_reads(self.kernel, dtype)

    def kv_layout(self, dtype: torch.dtype, block_size: int, head_dim: int, heads: int,
                  kv_heads: int) -> str:
        """`k_pairs` where the measured reads take K in pairs and the kernel takes the shape,
        `kv_pairs` where they are AMX tiles and the tiles take V in pairs too."""
        self.prepare(dtype)
        scores = self.reads[dtype].scores
        if not (dtype == torch.bfloat16 and scores in PAIRED and k_pairs.fits(block_size, head_dim)
                and head_dim <= self.kernel.max_head_dim and heads <= self.kernel.max_heads):
            return "rows"
        group = heads // kv_heads
        return "kv_pairs" if scores == "amx" and v_pairs.fits(block_size, head_dim, group) \
            else "k_pairs"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        t, heads, dim = q.shape
        if dim > self.kernel.max_head_dim or heads > self.kernel.max_heads:
            return self.fallback.forward(q, k, v, k_cache, v_cache, meta, scale)
        if meta.backend_state is None:  # the first layer's: the step's plan
            block_size = k_cache.shape[1]
            layout = self.kv_layout(q.dtype, block_size, dim, heads, k.shape[1])
            meta.backend_state = PagedPlan.make(meta, block_size, q.dtype, layout)
        plan: PagedPlan = meta.backend_state
        k_paired, v_paired = plan.layout != "rows", plan.layout == "kv_pairs"
        reads = self.reads[q.dtype]
        scores = reads.scores_code
        if reads.scores in PAIRED and not k_paired:  # a shape that does not take pairs
            scores = SCORES["lanes"]
        elif v_paired:
            scores = AMX_V_PAIRS
        if plan.rows is None:  # every row decodes: its new K/V stored by the kernel
            return self.kernel.paged_decode(q, k_cache, v_cache, plan.tables, plan.lens, scale,
                                            k, v, reads.ahead, reads.hint_code, scores,
                                            reads.v_rows).view(t, -1)
        (k_pairs.store if k_paired else store_rows)(k, k_cache, meta.slot_mapping)
        (v_pairs.store if v_paired else store_rows)(v, v_cache, meta.slot_mapping)
        out = q.new_empty(t, heads * dim)
        if plan.rows.numel():
            o = self.kernel.paged_decode(q.index_select(0, plan.rows), k_cache, v_cache,
                                         plan.tables, plan.lens, scale, None, None,
                                         reads.ahead, reads.hint_code, scores, reads.v_rows)
            out.index_copy_(0, plan.rows, o.view(-1, heads * dim))
        prefill_into(out, q, k, v, k_cache, v_cache, plan.prefills, scale,
                     k_pairs.gather if k_paired else None, v_pairs.gather if v_paired else None)
        return out
