"""The torch backend: paged attention with `F.scaled_dot_product_attention`.

A step's new tokens are flattened into T rows. Each layer first writes the new K/V into the cache
through `slot_mapping`, then every sequence attends over its whole context read back through its
block table. Decode rows (one new token) are batched into one SDPA call per group of similar
context lengths, padded to the group's longest with a mask; prefill chunks run one SDPA call
per sequence. GQA never copies K/V per query head: for decode the query heads sharing a KV head
become the "query length" axis; for prefill SDPA's `enable_gqa` does the grouping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixserve.workers.attention.base import AttentionBackend
from prefixserve.workers.attention.metadata import AttentionMetadata


@dataclass
class Prefill:
    start: int  # first flat row
    end: int
    context_len: int
    blocks: torch.Tensor | None  # block ids covering the context; None: no cached prefix
    mask: torch.Tensor | None  # [q, context] additive: 0 where attention is allowed, else -inf


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # flat rows of its sequences; None: every row of the step, in order
    blocks: torch.Tensor  # [n * num_blocks] block ids, row-major
    num_blocks: int  # blocks per sequence, after padding to the group's longest context
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size] additive: 0 on real context


# Decode rows are padded to their group's longest context. A row starts a new group when that
# would more than double its reads, unless the contexts are short enough that one more SDPA
# call costs more than the padding.
_SPLIT_MIN_CONTEXT = 256


@dataclass
class SDPAPlan:
    decode: list[_DecodeGroup]
    prefills: list[Prefill]

    @classmethod
    def make(cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> SDPAPlan:
        q_lens, ctx_lens = meta.host_lens()
        device = meta.slot_mapping.device
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        dec = sorted((i for i, q in enumerate(q_lens) if q == 1), key=lambda i: -ctx_lens[i])
        groups: list[list[int]] = []
        for i in dec:
            longest = ctx_lens[groups[-1][0]] if groups else 0
            if not groups or (2 * ctx_lens[i] < longest and longest > _SPLIT_MIN_CONTEXT):
                groups.append([])
            groups[-1].append(i)
        # One group holding every row of the step keeps step order: no gather/scatter of rows.
        whole = len(groups) == 1 and len(dec) == len(q_lens)
        decode = []
        for g in groups:
            g = sorted(g) if whole else g
            nb = -(-max(ctx_lens[i] for i in g) // block_size)
            idx = torch.tensor(g, dtype=torch.long, device=device)
            ctx = torch.tensor([ctx_lens[i] for i in g], device=device)
            keys = torch.arange(nb * block_size, device=device)
            decode.append(
                _DecodeGroup(
                    rows=None if whole else torch.tensor([starts[i] for i in g], device=device),
                    blocks=meta.block_tables.index_select(0, idx)[:, :nb].reshape(-1),
                    num_blocks=nb,
                    mask=_additive(keys[None, :] < ctx[:, None], dtype).view(len(g), 1, 1, -1),
                )
            )
        return cls(decode=decode, prefills=prefill_plans(meta, block_size, dtype))

    @classmethod
    def static_decode(cls, meta: AttentionMetadata, block_size: int,
                      dtype: torch.dtype) -> SDPAPlan:
        """Every row one decode token over its whole block-table width, masked to its context
        on the device: the plan a captured step can replay (`workers.decode_graphs`)."""
        n, width = meta.block_tables.shape
        keys = torch.arange(width * block_size, device=meta.context_lens.device)
        allowed = keys[None, :] < meta.context_lens[:, None]
        group = _DecodeGroup(rows=None, blocks=meta.block_tables.reshape(-1), num_blocks=width,
                             mask=_additive(allowed, dtype).view(n, 1, 1, -1))
        return cls(decode=[group], prefills=[])


def prefill_plans(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> list[Prefill]:
    """Each prefill chunk's rows, and its cached blocks and causal mask where it has a prefix."""
    q_lens, ctx_lens = meta.host_lens()
    device = meta.slot_mapping.device
    prefills, start = [], 0
    for i, (q, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        if q > 1:
            blocks = mask = None
            if ctx > q:
                blocks = meta.block_tables[i, : -(-ctx // block_size)]
                keys = torch.arange(ctx, device=device)
                limit = torch.arange(ctx - q, ctx, device=device)
                mask = _additive(keys[None, :] <= limit[:, None], dtype)
            prefills.append(Prefill(start, start + q, ctx, blocks, mask))
        start += q
    return prefills


def sdpa_plan(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> SDPAPlan:
    """The step's plan: built by the first layer, kept in `meta.backend_state` for the rest."""
    if meta.backend_state is None:
        meta.backend_state = SDPAPlan.make(meta, block_size, dtype)
    return meta.backend_state


class TorchSDPABackend(AttentionBackend):
    """Runs on any device torch does: the default, and the CPU's where the kernel cannot build."""

    name = "torch_sdpa"

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
        store_kv(k, v, k_cache, v_cache, meta)
        plan = sdpa_plan(meta, k_cache.shape[1], q.dtype)
        if plan.decode and plan.decode[0].rows is None:
            return _decode(q, k_cache, v_cache, plan.decode[0], scale)
        out = q.new_empty(t, heads * dim)
        for g in plan.decode:
            qd = q.index_select(0, g.rows)
            out.index_copy_(0, g.rows, _decode(qd, k_cache, v_cache, g, scale))
        prefill_into(out, q, k, v, k_cache, v_cache, plan.prefills, scale)
        return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Write the step's new K/V rows into their slots."""
    store_rows(k, k_cache, meta.slot_mapping)
    store_rows(v, v_cache, meta.slot_mapping)


def store_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new rows x [T, kvh, D] at their slots of a position-major K or V cache."""
    kvh, dim = cache.shape[2:]
    cache.view(-1, kvh, dim).index_copy_(0, slots, x)


def prefill_into(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, prefills: list[Prefill], scale: float,
    gather_k: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    gather_v: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> None:
    """Each prefill chunk's attention, one SDPA call per sequence, into its rows of `out`.
    `gather_k` and `gather_v` read a cached prefix's K and V where they are not
    position-major."""
    heads, dim = q.shape[1:]
    for p in prefills:
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if p.blocks is None:
            kp = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vp = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
        else:
            kp = (gather_k or _gather)(k_cache, p.blocks, p.context_len)
            vp = (gather_v or _gather)(v_cache, p.blocks, p.context_len)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
            enable_gqa=True,
        )
        out[p.start : p.end] = o[0].transpose(0, 1).reshape(p.end - p.start, heads * dim)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive float mask, once per step (SDPA would convert it in every layer)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached K or V as [1, kvh, length, D]."""
    kvh, dim = cache.shape[2:]
    flat = _blocks(cache, blocks).view(-1, kvh, dim)[:length]
    return flat.transpose(0, 1).unsqueeze(0)


def _blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks by id; on a 2-D view index_select copies rows with memcpy (2x faster)."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _DecodeGroup, scale: float
) -> torch.Tensor:
    """One-token rows of a group at once: q [n, H, D] -> [n, H * D]."""
    n, heads, dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    length = g.num_blocks * block_size
    k = _blocks(k_cache, g.blocks).view(n, length, kvh, dim).transpose(1, 2)
    v = _blocks(v_cache, g.blocks).view(n, length, kvh, dim).transpose(1, 2)
    qg = q.view(n, kvh, heads // kvh, dim)  # query heads of one KV head act as its query rows
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
    return o.reshape(n, heads * dim)
