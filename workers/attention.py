"""Paged attention over the one preallocated KV tensor.

A step's new tokens are flattened into T rows. Each layer first writes the new K/V into the cache
through `slot_mapping`, then every sequence attends over its whole context read back through its
block table. Decode rows (one new token) are batched into one SDPA call per group of similar
context lengths, padded to the group's longest with a mask; prefill chunks run one SDPA call
per sequence. GQA never copies K/V
per query head: for decode the query heads sharing a KV head become the "query length" axis; for
prefill SDPA's `enable_gqa` does the grouping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache; built by the core side each step.

    Sequence i owns the flat rows `query_start_loc[i]:query_start_loc[i+1]`; its new tokens are
    the last `query_len` of its `context_lens[i]` tokens. All tensors are int64 on the model's
    device. `query_lens_cpu` / `context_lens_cpu` are optional host copies that save a
    device-to-host sync; they are derived from the tensors when left as None.
    """

    slot_mapping: torch.Tensor  # [T] block_id * block_size + offset of each new token's K/V
    query_start_loc: torch.Tensor  # [B+1] cumulative new-token counts
    context_lens: torch.Tensor  # [B] tokens of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0 (never read past context_lens)
    logits_indices: torch.Tensor  # [B'] flat rows whose logits are returned
    query_lens_cpu: list[int] | None = None
    context_lens_cpu: list[int] | None = None
    _plan: _Plan | None = field(default=None, init=False, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        logits_indices: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from plain lists; logits default to each sequence's last new token."""
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        if logits_indices is None:
            logits_indices = [end - 1 for end in qsl[1:]]
        width = max((len(b) for b in block_tables), default=0) or 1
        bt = torch.zeros(len(block_tables), width, dtype=torch.long)
        for i, row in enumerate(block_tables):
            bt[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        pos = _new_positions(query_lens, context_lens)
        slots = bt[seq, pos // block_size] * block_size + pos % block_size

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        return cls(
            slot_mapping=dev(slots),
            query_start_loc=dev(torch.tensor(qsl, dtype=torch.long)),
            context_lens=dev(torch.tensor(context_lens, dtype=torch.long)),
            block_tables=dev(bt),
            logits_indices=dev(torch.tensor(logits_indices, dtype=torch.long)),
            query_lens_cpu=list(query_lens),
            context_lens_cpu=list(context_lens),
        )

    def positions(self) -> torch.Tensor:
        """Position of every new token (its index in its sequence): the model's `positions`."""
        return _new_positions(*self._host_lens()).to(self.slot_mapping.device)

    def _host_lens(self) -> tuple[list[int], list[int]]:
        if self.query_lens_cpu is None:
            self.query_lens_cpu = self.query_start_loc.diff().tolist()
        if self.context_lens_cpu is None:
            self.context_lens_cpu = self.context_lens.tolist()
        return self.query_lens_cpu, self.context_lens_cpu

    def plan(self, block_size: int, dtype: torch.dtype) -> _Plan:
        """Per-step index tensors and masks shared by all layers (built once per forward)."""
        if self._plan is None:
            self._plan = _Plan.make(self, block_size, dtype)
        return self._plan


def _new_positions(query_lens: list[int], context_lens: list[int]) -> torch.Tensor:
    """Each new token's index in its sequence, flattened in row order."""
    q = torch.tensor(query_lens, dtype=torch.long)
    row_start = torch.cumsum(q, 0) - q
    first = torch.tensor(context_lens, dtype=torch.long) - q  # position of the first new token
    return torch.arange(int(q.sum())) + torch.repeat_interleave(first - row_start, q)


@dataclass
class _Prefill:
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
class _Plan:
    decode: list[_DecodeGroup]
    prefills: list[_Prefill]

    @classmethod
    def make(cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> _Plan:
        q_lens, ctx_lens = meta._host_lens()
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
        prefills = []
        for i, q in enumerate(q_lens):
            if q <= 1:
                continue
            ctx = ctx_lens[i]
            blocks = mask = None
            if ctx > q:
                blocks = meta.block_tables[i, : -(-ctx // block_size)]
                keys = torch.arange(ctx, device=device)
                limit = torch.arange(ctx - q, ctx, device=device)
                mask = _additive(keys[None, :] <= limit[:, None], dtype)
            prefills.append(_Prefill(starts[i], starts[i] + q, ctx, blocks, mask))
        return cls(decode=decode, prefills=prefills)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store k/v [T, kvh, D] at `slot_mapping`, attend q [T, H, D]; returns [T, H * D].

    k_cache / v_cache are one layer's [num_blocks, block_size, kvh, D] views of the KV tensor.
    """
    block_size, kvh, dim = k_cache.shape[1:]
    t, heads, _ = q.shape
    k_cache.view(-1, kvh, dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, dim).index_copy_(0, meta.slot_mapping, v)
    plan = meta.plan(block_size, q.dtype)
    if plan.decode and plan.decode[0].rows is None:
        return _decode(q, k_cache, v_cache, plan.decode[0], scale)
    out = q.new_empty(t, heads * dim)
    for g in plan.decode:
        qd = q.index_select(0, g.rows)
        out.index_copy_(0, g.rows, _decode(qd, k_cache, v_cache, g, scale))
    for p in plan.prefills:
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if p.blocks is None:
            kp = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vp = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
        else:
            kp = _gather(k_cache, p.blocks, p.context_len)
            vp = _gather(v_cache, p.blocks, p.context_len)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )
        out[p.start : p.end] = o[0].transpose(0, 1).reshape(p.end - p.start, heads * dim)
    return out


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
