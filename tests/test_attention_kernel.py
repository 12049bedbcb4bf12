"""The CPU paged-decode kernel against a float64 referee, through the backend as the model calls
it: any head size and grouping, block tables in any order, contexts ending anywhere in a block,
decode rows mixed with prefill chunks, and bad tables refused rather than read."""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from test_layer_ops import check_every_op
from test_quantization import check_int4_linear
from test_sampling import check_argmax
from test_small_linear import check_small_linear, measured_once
from test_tile_linear import check_tile_linear

from prefixserve.workers.attention import k_pairs, kv_reads, registry, v_pairs
from prefixserve.workers.attention.cpu_paged import CPUPagedBackend
from prefixserve.workers.attention.kv_reads import KVReads
from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend
from prefixserve.workers.kernels import build
from prefixserve.workers.kernels.build import cpu_kernels

KERNEL = cpu_kernels()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain to build the kernel")

BS = 16


def referee(q, k_cache, v_cache, table, ctx, scale):
    """One decode row's attention in float64 from its blocks: q [H, D] -> [H, D]."""
    heads, dim = q.shape
    kvh = k_cache.shape[2]
    k = k_cache[table].reshape(-1, kvh, dim)[:ctx].double()
    v = v_cache[table].reshape(-1, kvh, dim)[:ctx].double()
    k = k.repeat_interleave(heads // kvh, dim=1)  # [ctx, H, D]
    v = v.repeat_interleave(heads // kvh, dim=1)
    w = torch.softmax(torch.einsum("hd,chd->hc", q.double(), k) * scale, dim=-1)
    return torch.einsum("hc,chd->hd", w, v)


def in_layout(k_cache, v_cache, layout):
    """Position-major caches as copies in `layout` (`attention.layouts`)."""
    k = k_pairs.to_pairs(k_cache) if layout != "rows" else k_cache.clone()
    v = v_pairs.to_pairs(v_cache) if layout == "kv_pairs" else v_cache.clone()
    return k, v


def out_of_layout(k_cache, v_cache, layout):
    """The inverse of `in_layout`."""
    k = k_pairs.to_rows(k_cache) if layout != "rows" else k_cache
    v = v_pairs.to_rows(v_cache) if layout == "kv_pairs" else v_cache
    return k, v


def decode_step(ctx_lens, heads, kvh, dim, dtype, seed=0):
    """A decode step over shuffled blocks: the backend's inputs, with the new K/V already in the
    step's rows (the backend stores them before attending), and q, k and v views of one fused
    projection's output, as the model passes them."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-c // BS) for c in ctx_lens]
    num_blocks = sum(per) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in per:
        tables.append(order[at : at + n])
        at += n
    k_cache = torch.randn(num_blocks, BS, kvh, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BS, kvh, dim, generator=g).to(dtype)
    meta = AttentionMetadata.build([1] * len(ctx_lens), ctx_lens, tables, BS)
    qkv = torch.randn(len(ctx_lens), heads + 2 * kvh, dim, generator=g).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kvh], qkv[:, heads + kvh :]
    return q, k, v, k_cache, v_cache, meta, tables


# each way to compute scores this build has for bf16 (AMX tiles where the CPU has them, K in
# pairs where it has AVX512-BF16; fp32 asked for either takes lane sums), and each count of V
# rows per pass
SCORES = [*kv_reads.scores_offered(KERNEL, torch.bfloat16)] if KERNEL else ["lanes", "tiles"]
READS = [KVReads(0, "t0", scores, v_rows) for scores in SCORES for v_rows in kv_reads.V_ROWS]


@needs_kernel
@pytest.mark.parametrize("reads", READS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kvh,dim", [(8, 2, 32), (9, 3, 64), (4, 4, 24), (12, 3, 16),
                                           (4, 1, 128), (2, 2, 72), (32, 8, 64), (20, 4, 96),
                                           (24, 3, 128)])
def test_decode_rows_match_the_referee(dtype, tol, heads, kvh, dim, reads) -> None:
    """Every head layout, each way of summing scores and adding up V, contexts around block
    and tile ends."""
    assert_matches_referee(KERNEL, [1, BS - 1, BS, BS + 1, 3 * BS + 5, 100], heads, kvh, dim,
                           dtype, tol, reads)


@needs_kernel
@pytest.mark.parametrize("reads", READS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("threads,ctx_lens", [(2, [1000]), (3, [600, 257]), (4, [517]),
                                              (2, [40, 1000, 40, 40])])
def test_a_step_is_shared_among_threads_in_parts(threads, ctx_lens, dtype, tol, reads) -> None:
    """A step's positions are cut into a share a thread, so a lone long sequence, or a long one
    among short ones, is read in parts of whole blocks on several threads, their softmax sums
    merged after: each row still matches the referee, a cut one beside whole ones included."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert_matches_referee(KERNEL, ctx_lens, 9, 3, 64, dtype, tol, reads)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("reads", READS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_scores_past_a_floats_exp_are_taken_from_their_largest(threads, dtype, tol,
                                                                reads) -> None:
    """Scores in the hundreds, whose exp overflows a float: each head's largest is taken out
    before exp, in one pass and in parts merged after; so is a lone one far above the rest,
    wherever it falls among the vectors the largest is found in."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert_matches_referee(KERNEL, [BS + 1, 1000], 9, 3, 64, dtype, tol, reads, q_times=60)
        assert_matches_referee(KERNEL, [1000, 1000, 1000, 100], 9, 3, 64, dtype, tol, reads,
                               spikes=(40, 970, 998, 7))
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("ctx_lens", [[1000], [40, 1000, 40]])
def test_a_cut_sequence_sums_in_another_order(ctx_lens) -> None:
    """The parts ran: on two threads a 1,000-position row, alone or among short ones, is not bit
    for bit the one thread's, whose single pass sums in another order (each matches the
    referee, above)."""
    q, k, v, k_cache, v_cache, meta, _ = decode_step(ctx_lens, 9, 3, 64, torch.float32)
    backend, before = CPUPagedBackend(KERNEL), torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 0.125))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    long = ctx_lens.index(1000)
    assert not torch.equal(outs[0][long], outs[1][long])


def assert_matches_referee(kernel, ctx_lens, heads, kvh, dim, dtype, tol,
                           reads: KVReads | None = None, q_times: float = 1.0,
                           spikes: tuple[int, ...] = ()) -> None:
    """A decode step through the backend on `kernel` (reading K/V as `reads` says, else as
    measured), q multiplied by `q_times`, each row against the float64 referee. Row i's first
    head scores far above the rest (hundreds) at position spikes[i], if given."""
    q, k, v, k_cache, v_cache, meta, tables = decode_step(ctx_lens, heads, kvh, dim, dtype)
    q = q * q_times
    for i, pos in enumerate(spikes):
        k_cache[tables[i][pos // BS], pos % BS, 0] = 50 * q[i, 0]
    scale = 1 / math.sqrt(dim)
    backend = CPUPagedBackend(kernel)
    if reads is not None:
        backend.reads[dtype] = reads
    layout = backend.kv_layout(dtype, BS, dim, heads, kvh)
    scores = backend.reads[dtype].scores
    assert (layout != "rows") == (dtype == torch.bfloat16 and scores in kv_reads.PAIRED)
    assert (layout == "kv_pairs") == (layout != "rows" and scores == "amx" and dim % 32 == 0
                                      and heads // kvh <= 16)
    stored = in_layout(k_cache, v_cache, layout)
    out = backend.forward(q, k, v, *stored, meta, scale)
    k_cache, v_cache = out_of_layout(*stored, layout)  # with the new rows
    assert out.shape == (len(ctx_lens), heads * dim) and out.dtype == dtype
    for i, ctx in enumerate(ctx_lens):
        want = referee(q[i], k_cache, v_cache, tables[i], ctx, scale)
        torch.testing.assert_close(out[i].view(heads, dim).double(), want, atol=tol, rtol=tol)


@needs_kernel
def test_the_new_token_is_stored_and_attended() -> None:
    """The step's own K/V land in the cache before the kernel reads them: with every cached key
    far from q except its own, the output is that row's V."""
    heads, kvh, dim = 4, 2, 32
    q, k, v, k_cache, v_cache, meta, _ = decode_step([BS + 3], heads, kvh, dim, torch.float32)
    k_cache.zero_()
    k.copy_(q.view(1, kvh, 2, dim)[:, :, 0] * 50)
    q.view(1, kvh, 2, dim)[:, :, 1] = q.view(1, kvh, 2, dim)[:, :, 0]
    out = CPUPagedBackend(KERNEL).forward(q, k, v, k_cache, v_cache, meta, 1.0)
    torch.testing.assert_close(out.view(heads, dim), v[0].repeat_interleave(2, dim=0))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_stores_its_kv_where_the_slot_mapping_says(dtype) -> None:
    """In a step of decode rows only, the kernel stores the new K/V itself, at each sequence's
    last position in its block table: the cache ends bit-equal to the torch backend's, which
    stores by the slot mapping."""
    step = ([1, BS, BS + 1, 37, 64], 9, 3, 64, dtype)
    q, k, v, got_k, got_v, meta, _ = decode_step(*step)
    backend = CPUPagedBackend(KERNEL)
    layout = backend.kv_layout(dtype, BS, 64, 9, 3)  # as measured here
    stored = in_layout(got_k, got_v, layout)
    got = backend.forward(q, k, v, *stored, meta, 0.125)
    got_k, got_v = out_of_layout(*stored, layout)
    q, k, v, k_cache, v_cache, meta, _ = decode_step(*step)
    before = k_cache.clone()
    want = TorchSDPABackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert not torch.equal(k_cache, before)
    assert torch.equal(got_k, k_cache) and torch.equal(got_v, v_cache)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_a_mixed_step_decodes_with_the_kernel_and_prefills_as_sdpa_does() -> None:
    """Rows of a step with prefill chunks (one with a cached prefix) between decode rows: the
    prefill rows equal the torch backend's exactly, the decode rows within float rounding."""
    heads, kvh, dim = 8, 2, 32
    q_lens, ctx_lens = [1, 7, 1, 20, 1], [40, 7, 17, 52, 3]
    tables = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(12, BS, kvh, dim, generator=g)
    v_cache = torch.randn(12, BS, kvh, dim, generator=g)
    t = sum(q_lens)
    q = torch.randn(t, heads, dim, generator=g)
    k, v = torch.randn(t, kvh, dim, generator=g), torch.randn(t, kvh, dim, generator=g)

    def run(backend):
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, BS)
        kc, vc = k_cache.clone(), v_cache.clone()
        return backend.forward(q, k, v, kc, vc, meta, 0.2), kc

    got, got_cache = run(CPUPagedBackend(KERNEL))
    want, want_cache = run(TorchSDPABackend())
    assert torch.equal(got_cache, want_cache)
    decode_rows = [0, 8, 29]
    prefill_rows = [r for r in range(t) if r not in decode_rows]
    assert torch.equal(got[prefill_rows], want[prefill_rows])
    torch.testing.assert_close(got[decode_rows], want[decode_rows], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_head_too_large_for_the_kernel_is_served_by_sdpa() -> None:
    dim = KERNEL.max_head_dim + 16
    q, k, v, k_cache, v_cache, meta, _ = decode_step([5, 30], 2, 1, dim, torch.float32)
    got = CPUPagedBackend(KERNEL).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.1)
    want = TorchSDPABackend().forward(q, k, v, k_cache, v_cache, meta, 0.1)
    assert torch.equal(got, want)


@needs_kernel
def test_rows_asked_for_ahead_are_in_the_built_kernel() -> None:
    """GCC once dropped every prefetch of the K/V rows (it counted a helper of prefetch builtins
    alone as free of effects), and the measured choice weighed asking ahead against itself: the
    built kernel holds the hint that only paged decode gives (the tile weights ask with t0 and
    t1)."""
    objdump = shutil.which("objdump")
    if objdump is None or "86" not in os.uname().machine:
        pytest.skip("needs objdump and an x86 build")
    code = subprocess.run([objdump, "-d", KERNEL.__file__], capture_output=True, text=True,
                          check=True).stdout
    assert "prefetchnta" in code


@needs_kernel
@pytest.mark.parametrize("reads", READS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asking_for_rows_ahead_changes_no_value(dtype, reads) -> None:
    """Prefetching reads nothing into the result: any distance, shorter or longer than the
    sequences (so that it runs into V's rows and the next sequence's K), with either hint,
    gives the same bits, and the cache the same stored rows."""
    step = ([1, 5, BS, 2 * BS + 3, 70], 9, 3, 64, dtype)
    outs = []
    if reads.scores in kv_reads.PAIRED and dtype == torch.float32:
        q, k, v, k_cache, v_cache, meta, _ = decode_step(*step)
        with pytest.raises(RuntimeError, match="K in pairs needs bf16, a head size in 4s"):
            KERNEL.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                0.125, k, v, 0, 3, reads.scores_code, reads.v_rows)
        return
    for ahead, hint in [(0, "t0"), (1, "t0"), (4, "nta"), (32, "t0"), (32, "t1"), (32, "nta"),
                        (1000, "nta")]:
        q, k, v, k_cache, v_cache, meta, _ = decode_step(*step)
        out = KERNEL.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                  0.125, k, v, ahead, kv_reads.HINTS[hint], reads.scores_code,
                                  reads.v_rows)
        outs.append((out, k_cache, v_cache))
    for out, k_cache, v_cache in outs[1:]:
        assert torch.equal(out, outs[0][0])
        assert torch.equal(k_cache, outs[0][1]) and torch.equal(v_cache, outs[0][2])
    with pytest.raises(RuntimeError, match="ahead must be >= 0, not -1"):
        KERNEL.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125,
                            None, None, -1)
    for args, error in [((0, 3, 0, 2), "v_rows must be 1 or 4, not 2"),
                        ((0, 1, 0, 1), "hint must be 0, 2 or 3, not 1"),
                        ((0, 3, 5, 1), "scores must be 0 to 4, not 5")]:
        with pytest.raises(RuntimeError, match=error):
            KERNEL.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125,
                                None, None, *args)
    if not KERNEL.amx_tiles:
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            KERNEL.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125,
                                None, None, 0, 3, 2, 1)
    if not KERNEL.k_pairs:
        with pytest.raises(RuntimeError, match="K in pairs needs AVX512-BF16"):
            KERNEL.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125,
                                None, None, 0, 3, 3, 1)


@needs_kernel
@pytest.mark.skipif(KERNEL is None or not KERNEL.amx_tiles, reason="no AMX-BF16 tiles here")
def test_amx_scores_are_summed_a_step_of_32_values_at_a_time() -> None:
    """Scores on AMX tiles are the tile unit's: a KV head's products summed in float a step of 32
    values at a time. A position whose products cancel only across steps (2^24 + 1 - 2^24) scores
    0 there, and 1 as lane sums (which add values 16 apart first), so the two ways weigh its V row
    differently: e^0 / (e^0 + e^0.5) against e / (e + e^0.5). The tiles read K in pairs."""
    k_cache, v_cache = torch.zeros(1, BS, 1, 64), torch.zeros(1, BS, 1, 64)
    q = torch.zeros(1, 1, 64)
    q[0, 0, [0, 1, 32]] = 1
    k_cache[0, 0, 0, [0, 1, 32]] = torch.tensor([2.0**24, 1, -(2.0**24)])
    k_cache[0, 1, 0, 1] = 0.5  # the other position scores 0.5 either way
    v_cache[0, 0] = 1
    rest = (v_cache.bfloat16(), torch.zeros(1, 1).long(), torch.tensor([2]), 1.0, None, None, 0,
            kv_reads.HINTS["t0"])
    rows, pairs = k_cache.bfloat16(), k_pairs.to_pairs(k_cache.bfloat16())
    lanes = KERNEL.paged_decode(q.bfloat16(), rows, *rest, kv_reads.SCORES["lanes"], 1)
    amx = KERNEL.paged_decode(q.bfloat16(), pairs, *rest, kv_reads.SCORES["amx"], 1)
    assert lanes[0, 0, 0].item() == pytest.approx(math.e / (math.e + math.exp(0.5)), abs=4e-3)
    assert amx[0, 0, 0].item() == pytest.approx(1 / (1 + math.exp(0.5)), abs=4e-3)


@needs_kernel
@pytest.mark.skipif(KERNEL is None or not KERNEL.amx_tiles, reason="no AMX-BF16 tiles here")
@pytest.mark.parametrize("layout", ["k_pairs", "kv_pairs"])
@pytest.mark.parametrize("block_size", [16, 32, 48])
@pytest.mark.parametrize("dim", [32, 64])
def test_amx_tiles_take_a_block_16_positions_a_tile(dim, block_size, layout) -> None:
    """Scores on AMX tiles (and with V in pairs the weighted sum too) read blocks of 16, 32 or
    48 positions a tile of 16 at a time from within the block, the new token's K (and V) stored
    in pairs at its place; rows ending anywhere in a block match the referee, the positions
    past a row's end weighing nothing whatever the block holds there (NaN here)."""
    g = torch.Generator().manual_seed(7)
    heads, kvh, lens = 9, 3, [1, 17, block_size + 5, 3 * block_size]
    k_cache, v_cache = (torch.randn(13, block_size, kvh, dim, generator=g).bfloat16()
                        for _ in range(2))
    tables = torch.randperm(13, generator=g)[:12].view(4, 3).contiguous()
    for i, ctx in enumerate(lens):  # past each row's end (its new token's slot included): NaN
        for at in range(ctx - 1, 3 * block_size):
            k_cache[tables[i, at // block_size], at % block_size] = float("nan")
            v_cache[tables[i, at // block_size], at % block_size] = float("nan")
    q = torch.randn(4, heads, dim, generator=g).bfloat16()
    k, v = (torch.randn(4, kvh, dim, generator=g).bfloat16() for _ in range(2))
    stored = in_layout(k_cache, v_cache, layout)
    code = kv_reads.AMX_V_PAIRS if layout == "kv_pairs" else kv_reads.SCORES["amx"]
    out = KERNEL.paged_decode(q, *stored, tables, torch.tensor(lens), 0.125, k, v, 0, 3, code, 1)
    k_cache, v_cache = out_of_layout(*stored, layout)
    assert not out.isnan().any()
    for i, ctx in enumerate(lens):
        last = tables[i, (ctx - 1) // block_size], (ctx - 1) % block_size
        assert torch.equal(k_cache[last], k[i]) and torch.equal(v_cache[last], v[i])
        want = referee(q[i], k_cache, v_cache, tables[i], ctx, 0.125)
        torch.testing.assert_close(out[i].double(), want, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.skipif(KERNEL is None or not KERNEL.amx_tiles, reason="no AMX-BF16 tiles here")
@pytest.mark.parametrize("heads,kvh,dim", [(8, 2, 48), (4, 4, 16), (18, 1, 64)])
def test_amx_scores_take_pair_products_where_the_tiles_do_not_fit(heads, kvh, dim) -> None:
    """A head not in 32s, or more than 16 query heads a KV head: asked for AMX tiles, the kernel
    reads K in pairs with pair products, bit for bit."""
    step = decode_step([1, BS + 3, 40], heads, kvh, dim, torch.bfloat16)
    q, k, v, k_cache, v_cache, meta, _ = step
    outs = [KERNEL.paged_decode(q, k_pairs.to_pairs(k_cache), v_cache, meta.block_tables,
                                meta.context_lens, 0.125, k, v, 0, 3, kv_reads.SCORES[scores], 1)
            for scores in ("amx", "pairs")]
    assert torch.equal(outs[0], outs[1])


@needs_kernel
def test_how_the_kernel_reads_kv_is_pinned_or_measured_once(monkeypatch, caplog) -> None:
    monkeypatch.setenv(kv_reads.AHEAD_ENV, "7")
    monkeypatch.setenv(kv_reads.HINT_ENV, "t1")
    monkeypatch.setenv(kv_reads.SCORES_ENV, "tiles")
    monkeypatch.setenv(kv_reads.V_ROWS_ENV, "4")
    assert kv_reads.kv_reads(KERNEL, torch.float32) == KVReads(7, "t1", "tiles", 4)
    monkeypatch.setenv(kv_reads.AHEAD_ENV, "0")  # nothing ahead: the hint is moot
    monkeypatch.setenv(kv_reads.SCORES_ENV, "lanes")
    monkeypatch.setenv(kv_reads.V_ROWS_ENV, "1")
    monkeypatch.delenv(kv_reads.HINT_ENV)
    backend = CPUPagedBackend(KERNEL)
    backend.prepare(torch.float32)
    assert backend.reads == {torch.float32: KVReads(0, "t0", "lanes", 1)}
    for env, value, error in [
            (kv_reads.AHEAD_ENV, "far", "whole number of rows up to 1048576, not 'far'"),
            (kv_reads.AHEAD_ENV, "99999999999999999999", "not '99999999999999999999'"),
            (kv_reads.HINT_ENV, "t2", "must be one of t0, t1, nta, not 't2'"),
            (kv_reads.SCORES_ENV, "yes", r"must be one of lanes, tiles, amx, pairs \(amx: bf16 "
                                         r"on a CPU with AMX; pairs: bf16 on a CPU with "
                                         r"AVX512-BF16\), not 'yes'"),
            (kv_reads.SCORES_ENV, "amx", "not 'amx'"),  # fp32 has no AMX scores
            (kv_reads.SCORES_ENV, "pairs", "not 'pairs'"),  # nor K in pairs
            (kv_reads.V_ROWS_ENV, "2", "must be one of 1, 4, not '2'")]:
        with monkeypatch.context() as m:
            m.setenv(env, value)
            with pytest.raises(ValueError, match=error):
                kv_reads.kv_reads(KERNEL, torch.float32)
    with caplog.at_level(logging.INFO, logger=kv_reads.__name__):  # V rows alone timed
        monkeypatch.delenv(kv_reads.V_ROWS_ENV)
        monkeypatch.setattr(kv_reads, "PROBE_BYTES", 1)
        kv_reads._measured.cache_clear()
        assert kv_reads.kv_reads(KERNEL, torch.float32).ahead == 0
        assert "ms with none ahead, scores: lanes, 1 V rows, " in caplog.text
        assert "ms with none ahead, scores: lanes, 4 V rows; " in caplog.text
        assert "32 ahead" not in caplog.text and "scores: tiles" not in caplog.text
        first = measured_once(monkeypatch, kv_reads,
                              lambda: kv_reads.kv_reads(KERNEL, torch.bfloat16))
    assert first in {KVReads(a, h if a else "t0", c, v) for a in kv_reads.AHEADS
                     for h in kv_reads.HINTS for c in SCORES for v in kv_reads.V_ROWS}
    assert f"bfloat16 paged decode reads K/V with {first}: " in caplog.text
    assert "32 ahead (nta), scores: tiles, 4 V rows" in caplog.text
    assert "32 ahead (t1), scores: lanes, 1 V rows" in caplog.text
    assert ("scores: amx" in caplog.text) == KERNEL.amx_tiles
    assert ("scores: pairs" in caplog.text) == KERNEL.k_pairs
    # each choice timed once, none ahead once per way of scores and V rows
    assert caplog.text.count(" ms with ") == 2 + 4 * len(SCORES) * len(kv_reads.V_ROWS)


@needs_kernel
def test_the_kernels_spread_their_work_over_torchs_threads() -> None:
    """Built with OpenMP, the kernels' at::parallel_for runs on torch's threads (a replica's
    CPUs); a build without it ran every kernel on the calling thread however many there were."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert (KERNEL.parallel_threads(8), KERNEL.parallel_threads(1)) == (2, 1)
        torch.set_num_threads(1)
        assert KERNEL.parallel_threads(8) == 1
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_bad_tables_are_refused_not_read() -> None:
    q, _, _, k_cache, v_cache, meta, _ = decode_step([20, 5], 4, 2, 32, torch.float32)
    tables, lens = meta.block_tables, meta.context_lens

    def call(**kw):
        args = dict(q=q, k=k_cache, v=v_cache, t=tables, c=lens) | kw
        return KERNEL.paged_decode(args["q"], args["k"], args["v"], args["t"], args["c"], 1.0)

    call()
    with pytest.raises(RuntimeError, match="context length 33 outside the block table"):
        call(c=torch.tensor([33, 5]))
    with pytest.raises(RuntimeError, match="context length 0"):
        call(c=torch.tensor([20, 0]))
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match=f"block id {k_cache.shape[0]} outside the cache"):
        call(t=bad)
    with pytest.raises(RuntimeError, match="with each row's heads contiguous"):
        call(q=q.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="k_new and v_new go together"):
        KERNEL.paged_decode(q, k_cache, v_cache, tables, lens, 1.0, k_new=q[:, :2])
    with pytest.raises(RuntimeError, match="k_new must be"):
        KERNEL.paged_decode(q, k_cache, v_cache, tables, lens, 1.0, k_new=q, v_new=q)
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(k=k_cache.double())
    with pytest.raises(RuntimeError, match="contiguous int64"):
        call(c=lens.int())


def test_the_build_name_follows_every_source_and_header(tmp_path) -> None:
    """A changed header (vec.h, which every vectorised kernel includes) is a new build, as a
    changed source is: never a stale library under the old name."""
    for source in build.source_files()[0].parent.iterdir():
        shutil.copy(source, tmp_path)
    name = build.build_name(sorted(tmp_path.glob("*.cpp")))
    assert name == build.build_name(build.source_files())
    for changed in ("vec.h", "small_linear.cpp"):
        (tmp_path / changed).write_text((tmp_path / changed).read_text() + "\n// changed\n")
        assert build.build_name(sorted(tmp_path.glob("*.cpp"))) != name
        name = build.build_name(sorted(tmp_path.glob("*.cpp")))


def test_a_kernel_that_cannot_build_leaves_sdpa_with_one_log_line(monkeypatch, tmp_path,
                                                                   caplog) -> None:
    """A failed build (here a flag no compiler knows) is a warning and no kernel; a lock left
    by a build killed long ago is cleared first, so it cannot hang every later process."""
    monkeypatch.setenv("PREFIXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "CFLAGS", ["-fno-such-flag-anywhere"])
    folder = tmp_path / "kernels" / build.build_name(build.source_files())
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    old = time.time() - build.STALE_LOCK_S - 60
    os.utime(folder / "lock", (old, old))
    with caplog.at_level(logging.WARNING):
        assert build.cpu_kernels.__wrapped__() is None
    assert "CPU kernels unavailable, attention uses torch SDPA" in caplog.text
    assert not (folder / "lock").exists()
    # torch's builder appends its link flags to the list it is given: a copy, or the next
    # build's name (and the cache it looks in) would change
    assert build.OPENMP == ["-fopenmp"]


def test_without_a_kernel_the_cpu_gets_sdpa_and_forcing_it_says_why(monkeypatch) -> None:
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    monkeypatch.setattr(registry, "cpu_kernels", lambda: None)
    assert type(registry.backend_for("cpu")) is TorchSDPABackend
    monkeypatch.setenv(registry.BACKEND_ENV, "cpu_paged")
    with pytest.raises(RuntimeError, match="cpu_paged, but the CPU kernel could not be built"):
        registry.backend_for("cpu")


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("arch,width", [("haswell", 8), ("x86-64", 8), ("skylake-avx512", 16),
                                        ("cooperlake", 16)])
def test_the_kernels_built_for_narrower_vectors_match_their_referees(arch, width, monkeypatch,
                                                                      caplog) -> None:
    """The same sources built for AVX2 (8-float vectors), for plain x86-64 (ATen's portable
    vectors), for AVX-512 without AVX512-BF16, and with it but without AMX (where the machine's
    own build has AMX): the machines of a fleet differ, and each builds for its own CPU. The
    layer ops are checked against torch's as tests/test_layer_ops.py checks this machine's build,
    the small-row and int4 linear layers against the dense product, the rows' argmax against
    torch's, and the tile weights' pairs engine (or its absence) against float64. Each target
    is built as a machine builds its own: once per digest of the sources, flags and CPU, into
    the kernels' cache."""
    if "86" not in os.uname().machine:
        pytest.skip("x86 targets")
    if arch == "haswell" and KERNEL.vector_width == width:
        pytest.skip("this machine's own build is the AVX2 one, checked by every other test")
    if width == 16 and "avx512f" not in build._cpu_flags().split():
        pytest.skip("this CPU cannot run AVX-512")
    if arch == "cooperlake" and ("avx512_bf16" not in build._cpu_flags().split()
                                 or KERNEL.tile_linear_engine == "pairs"):
        pytest.skip("the tile weights' pairs engine: this CPU cannot run it, or its own build "
                    "is that engine, checked by tests/test_tile_linear.py")
    monkeypatch.setattr(build, "CFLAGS", ["-O3", f"-march={arch}", "-ffast-math"])
    with caplog.at_level(logging.WARNING):
        kernel = build.cpu_kernels.__wrapped__()
    assert kernel is not None, caplog.text
    # where a later call looks for it (torch's builder once appended its link flags to ours)
    assert Path(kernel.__file__).parent.name == build.build_name(build.source_files())
    assert kernel.vector_width == width
    assert kernel.k_pairs == (arch == "cooperlake")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for (heads, kvh, dim), scores, v_rows in itertools.product(
                [(9, 3, 64), (4, 4, 24), (4, 1, 128)],
                kv_reads.scores_offered(kernel, torch.bfloat16), kv_reads.V_ROWS):
            assert_matches_referee(kernel, [1, BS, BS + 1, 100], heads, kvh, dim, dtype, tol,
                                   KVReads(0, "t0", scores, v_rows))
    check_every_op(kernel)
    for dtype in (torch.float32, torch.bfloat16):
        check_small_linear(kernel, dtype)
    check_int4_linear(kernel)
    check_argmax(kernel)
    assert kernel.tile_linear_engine == ("pairs" if arch == "cooperlake" else "")
    if arch == "cooperlake":
        check_tile_linear(kernel)
