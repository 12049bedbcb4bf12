"""The CPU backend: decode rows through the paged kernel, prefill chunks through torch SDPA.

The kernel (`workers.kernels`) reads each decode sequence's K/V from its blocks in place, once,
for all its heads; torch SDPA over the same rows has to gather the blocks into a padded copy
first and runs many small products below the memory's rate. In a step where every row decodes,
the kernel also stores the new K/V rows and reads q, k and v as views of the fused projection's
output, so a layer's attention is one call. Prefill chunks carry many query rows, where SDPA's
kernel is already efficient, so they keep the torch backend's path. How the kernel reads K/V
(rows asked for ahead and how, how scores are computed, V rows per pass) is measured per dtype
(`attention.kv_reads`); where the fastest reads K laid out in pairs (`attention.k_pairs`), this
backend stores and gathers K in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from prefixserve.workers.attention import k_pairs
from prefixserve.workers.attention.base import AttentionBackend
from prefixserve.workers.attention.kv_reads import PAIRED, SCORES, KVReads, kv_reads
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
    paired: bool  # K laid out in pairs (`CPUPagedBackend.k_layout`)

    @classmethod
    def make(cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype,
             paired: bool) -> PagedPlan:
        q_lens, _ = meta.host_lens()
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        if len(decode) == len(q_lens):
            return cls(None, meta.block_tables, meta.context_lens, [], paired)
        idx = torch.tensor(decode, dtype=torch.long, device=meta.slot_mapping.device)
        rows = meta.query_start_loc.index_select(0, idx)
        return cls(rows, meta.block_tables.index_select(0, idx).contiguous(),
                   meta.context_lens.index_select(0, idx),
                   prefill_plans(meta, block_size, dtype), paired)


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

    def k_layout(self, dtype: torch.dtype, block_size: int, head_dim: int, heads: int) -> str:
        """`pairs` where the measured reads take K in pairs and the kernel takes the shape."""
        self.prepare(dtype)
        paired = (dtype == torch.bfloat16 and self.reads[dtype].scores in PAIRED
                  and k_pairs.fits(block_size, head_dim) and head_dim <= self.kernel.max_head_dim
                  and heads <= self.kernel.max_heads)
        return "pairs" if paired else "rows"

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
            paired = self.k_layout(q.dtype, block_size, dim, heads) == "pairs"
            meta.backend_state = PagedPlan.make(meta, block_size, q.dtype, paired)
        plan: PagedPlan = meta.backend_state
        paired = plan.paired
        reads = self.reads[q.dtype]
        # reads measured with K in pairs, on a shape that does not take them: lane sums
        scores = SCORES["lanes"] if reads.scores in PAIRED and not paired else reads.scores_code
        if plan.rows is None:  # every row decodes: its new K/V stored by the kernel
            return self.kernel.paged_decode(q, k_cache, v_cache, plan.tables, plan.lens, scale,
                                            k, v, reads.ahead, reads.hint_code, scores,
                                            reads.v_rows).view(t, -1)
        if paired:
            k_pairs.store(k, k_cache, meta.slot_mapping)
        else:
            store_rows(k, k_cache, meta.slot_mapping)
        store_rows(v, v_cache, meta.slot_mapping)
        out = q.new_empty(t, heads * dim)
        if plan.rows.numel():
            o = self.kernel.paged_decode(q.index_select(0, plan.rows), k_cache, v_cache,
                                         plan.tables, plan.lens, scale, None, None,
                                         reads.ahead, reads.hint_code, scores, reads.v_rows)
            out.index_copy_(0, plan.rows, o.view(-1, heads * dim))
        prefill_into(out, q, k, v, k_cache, v_cache, plan.prefills, scale,
                     k_pairs.gather if paired else None)
        return out
