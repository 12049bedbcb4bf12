"""K laid out in pairs within each block (workers/attention/k_pairs.py), and V in pairs of
positions (v_pairs.py): their store and gather against the position-major cache's, the kernel's
decode and the backend's mixed steps over them, and an engine that chose them, in bf16, against
transformers through prefix hits, chunked prefill, preemption and both KV tiers, and disk files
that workers of any order share (layouts.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import pytest
import torch
from test_attention_kernel import KERNEL, in_layout, out_of_layout
from test_engine import assert_agrees_teacher_forced, prompts, write_checkpoint

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.attention import k_pairs, kv_reads, layouts, v_pairs
from prefixserve.workers.attention.cpu_paged import CPUPagedBackend
from prefixserve.workers.attention.kv_reads import KVReads
from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend, _gather, store_rows
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig

BF16 = torch.bfloat16
needs_pairs = pytest.mark.skipif(KERNEL is None or not KERNEL.k_pairs,
                                 reason="no AVX512-BF16 pair products in this build")


def stored_both_ways(order: ModuleType, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache position-major and the same in `order` (`k_pairs` or `v_pairs`), each with new
    rows stored: the two convert into each other, before and after, and gather the same."""
    g = torch.Generator().manual_seed(seed)
    nb, bs, kvh, dim = 6, 32, 3, 8
    rows = torch.randn(nb, bs, kvh, dim, generator=g).to(BF16)
    pairs = order.to_pairs(rows)
    assert pairs.shape == rows.shape and not torch.equal(pairs, rows)
    assert torch.equal(order.to_rows(pairs), rows)
    slots = torch.tensor([5, 40, 191, 64, 0])
    new = torch.randn(5, kvh, dim, generator=g).to(BF16)
    store_rows(new, rows, slots)
    order.store(new, pairs, slots)
    assert torch.equal(order.to_rows(pairs), rows)
    for blocks, length in [([4, 1], 40), ([0], 1), ([5, 2, 3], 96), ([3, 0], 33)]:
        blocks = torch.tensor(blocks)
        assert torch.equal(order.gather(pairs, blocks, length), _gather(rows, blocks, length))
    return rows, pairs


def test_store_and_gather_agree_with_the_position_major_cache() -> None:
    """Rows stored in pairs and read back are the rows stored position-major; the two layouts
    convert into each other; only whole 16-position vectors of pairs of dims are taken."""
    rows, pairs = stored_both_ways(k_pairs, 3)
    within = pairs.view(6, 3, 4, 32, 2)  # each block's order: [kv_heads, dim / 2, block, 2]
    assert within[2, 1, 3, 17].tolist() == rows[2, 17, 1, 6:8].tolist()
    assert k_pairs.fits(16, 64) and k_pairs.fits(32, 4)
    assert not k_pairs.fits(8, 64) and not k_pairs.fits(16, 6)


def test_v_in_pairs_of_positions_stores_and_gathers_as_the_position_major_cache() -> None:
    """V stored in pairs of positions and read back is V stored position-major; a position's
    values sit beside its neighbour's, dim by dim; the kernel's tiles take heads in 32s, up to
    16 query heads a KV head, blocks in 16s."""
    rows, pairs = stored_both_ways(v_pairs, 4)
    within = pairs.view(6, 3, 16, 8, 2)  # each block's order: [kv_heads, block / 2, dim, 2]
    assert within[2, 1, 8, 5].tolist() == rows[2, 16:18, 1, 5].tolist()
    # (block size, head size, query heads a KV head)
    assert all([v_pairs.fits(16, 64, 3), v_pairs.fits(32, 32, 16), v_pairs.fits(16, 128, 4),
                v_pairs.fits(16, 96, 5)])
    assert not any([v_pairs.fits(8, 64, 3), v_pairs.fits(16, 48, 3), v_pairs.fits(16, 64, 17)])


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_a_disk_copy_of_a_block_is_position_major_in_any_layout(layout: str) -> None:
    """A whole block's copy [layers, K/V, ...] converts to K and V position-major and back."""
    g = torch.Generator().manual_seed(5)
    block = torch.randn(2, 2, 16, 3, 8, generator=g).to(BF16)
    on_disk = layouts.block_to_rows(block, layout)
    k_rows = block[:, 0] if layout == "rows" else k_pairs.to_rows(block[:, 0])
    v_rows = v_pairs.to_rows(block[:, 1]) if layout == "kv_pairs" else block[:, 1]
    assert torch.equal(on_disk[:, 0], k_rows) and torch.equal(on_disk[:, 1], v_rows)
    assert torch.equal(layouts.block_from_rows(on_disk, layout), block)


@needs_pairs
@pytest.mark.parametrize("scores,layout", [("pairs", "k_pairs"), ("amx", "kv_pairs")])
def test_a_mixed_step_over_pairs_prefills_as_sdpa_does(scores: str, layout: str) -> None:
    """Decode rows and prefill chunks (one with a cached prefix, read back from the pairs) in
    one step, K in pairs (and with AMX tiles V too): the prefill rows equal the torch backend's
    over the position-major cache exactly, the decode rows within bf16 rounding, and the
    caches hold the same rows."""
    if scores == "amx" and not KERNEL.amx_tiles:
        pytest.skip("no AMX-BF16 tiles here")
    heads, kvh, dim, bs = 8, 2, 32, 16
    q_lens, ctx_lens = [1, 7, 1, 20, 1], [40, 7, 17, 52, 3]
    tables = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(12, bs, kvh, dim, generator=g).to(BF16)
    v_cache = torch.randn(12, bs, kvh, dim, generator=g).to(BF16)
    t = sum(q_lens)
    q = torch.randn(t, heads, dim, generator=g).to(BF16)
    k, v = (torch.randn(t, kvh, dim, generator=g).to(BF16) for _ in range(2))
    backend = CPUPagedBackend(KERNEL)
    backend.reads[BF16] = KVReads(32, "t1", scores, 4)
    assert backend.kv_layout(BF16, bs, dim, heads, kvh) == layout
    assert backend.kv_layout(BF16, 8, dim, heads, kvh) == "rows"  # blocks shorter than a vector
    # too short a head for the tiles, too many query heads a KV head for a tile's rows
    assert backend.kv_layout(BF16, bs, 16, heads, kvh) == "k_pairs"
    assert backend.kv_layout(BF16, bs, dim, 17, 1) == "k_pairs"
    stored = in_layout(k_cache, v_cache, layout)
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, bs)
    got = backend.forward(q, k, v, *stored, meta, 0.2)
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, bs)
    want = TorchSDPABackend().forward(q, k, v, k_cache, v_cache, meta, 0.2)
    got_k, got_v = out_of_layout(*stored, layout)
    assert torch.equal(got_k, k_cache) and torch.equal(got_v, v_cache)
    decode_rows = [0, 8, 29]
    prefill_rows = [r for r in range(t) if r not in decode_rows]
    assert torch.equal(got[prefill_rows], want[prefill_rows])
    torch.testing.assert_close(got[decode_rows].float(), want[decode_rows].float(),
                               atol=2e-2, rtol=2e-2)


@needs_pairs
def test_k_in_pairs_takes_lane_sums_where_the_shape_does_not_fit() -> None:
    """Reads measured with K in pairs, on blocks of 8 (half a vector): K stays position-major
    and the kernel sums lanes over it, as the torch backend's rows say."""
    g = torch.Generator().manual_seed(2)
    heads, kvh, dim, bs = 9, 3, 64, 8
    k_cache, v_cache = (torch.randn(6, bs, kvh, dim, generator=g).to(BF16) for _ in range(2))
    q = torch.randn(2, heads, dim, generator=g).to(BF16)
    k, v = (torch.randn(2, kvh, dim, generator=g).to(BF16) for _ in range(2))
    backend = CPUPagedBackend(KERNEL)
    backend.reads[BF16] = KVReads(0, "t0", "pairs", 1)
    assert backend.kv_layout(BF16, bs, dim, heads, kvh) == "rows"

    def run(b):
        meta = AttentionMetadata.build([1, 1], [5, 20], [[4], [0, 3, 5]], bs)
        kc, vc = k_cache.clone(), v_cache.clone()
        return b.forward(q, k, v, kc, vc, meta, 0.125), kc

    (got, got_k), (want, want_k) = run(backend), run(TorchSDPABackend())
    assert torch.equal(got_k, want_k)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def pinned_engine(path: Path, disk: Path, scores: str, monkeypatch, **kw) -> LLMEngine:
    """A bf16 engine in blocks of 16 whose K/V reads are pinned to `scores`, with a disk tier."""
    monkeypatch.setenv(kv_reads.SCORES_ENV, scores)
    return LLMEngine.from_pretrained(path, EngineConfig(
        device="cpu", dtype="bfloat16", block_size=16, kv_disk_dir=str(disk), **kw))


def layout(eng: LLMEngine) -> str:
    c = eng.model_config
    return eng.model.attention.kv_layout(BF16, 16, c.head_dim, c.num_attention_heads,
                                         c.num_key_value_heads)


@needs_pairs
@pytest.mark.parametrize("scores,order", [("pairs", "k_pairs"), ("amx", "kv_pairs")])
def test_an_engine_with_kv_in_pairs_agrees_with_transformers_through_hits_and_tiers(
        scores: str, order: str, tmp_path: Path, monkeypatch) -> None:
    """Pinned to K in pairs read with pair products, or to AMX tiles over K and V in pairs
    (heads of 32, which the tiles take): bf16 greedy tokens pass the low-precision referee
    cold, with prefix hits from the pool, under chunked prefill and preemption, and with the
    prefixes back from the host tier and from disk."""
    if scores == "amx" and not KERNEL.amx_tiles:
        pytest.skip("no AMX-BF16 tiles here")
    model = write_checkpoint(tmp_path / "llama", "llama", heads=2)
    eng = pinned_engine(tmp_path / "llama", tmp_path / "disk", scores, monkeypatch,
                        num_blocks=14, max_num_seqs=4, max_num_batched_tokens=48,
                        kv_offloading_size=64 * 2**20 / 2**30)
    assert layout(eng) == order
    hf = copy.deepcopy(model).to(BF16)
    batch = prompts(40, 44, 36, 50, start=11)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    cold = eng.generate(batch, params)
    assert eng.stats().num_preemptions > 0
    again = eng.generate(batch, params)
    assert sum(r.num_cached_tokens for r in again) > 0
    eng.generate(prompts(*[60] * 4, start=90), params)  # the pool's blocks move to the tiers
    eng.tiers.disk.flush()
    back = eng.generate(batch, params)
    assert eng.stats().external_tokens_hit > 0
    for results in (cold, again, back):
        assert_agrees_teacher_forced(hf, batch, results)
    assert eng.kv.num_free_blocks == 14
    eng.tiers.close()


@needs_pairs
def test_an_engine_of_more_query_heads_than_a_tile_has_rows_sums_v_in_windows(
        tmp_path: Path, monkeypatch) -> None:
    """32 query heads over 8 KV heads (a Llama-3.2-1B's counts), pinned to AMX tiles: V in
    pairs, summed in two windows of 16 heads, and bf16 greedy tokens pass the low-precision
    referee cold and with prefix hits."""
    if not KERNEL.amx_tiles:
        pytest.skip("no AMX-BF16 tiles here")
    # heads of 32 values; weights of HF's default spread (wider ones put bf16's rounding past
    # the referee's near-tie bound in this model's 1,024 dims whichever way K/V are read)
    model = write_checkpoint(tmp_path / "llama", "llama", heads=32, hidden=1024, kv_heads=8,
                             init=0.04)
    eng = pinned_engine(tmp_path / "llama", tmp_path / "disk", "amx", monkeypatch,
                        num_blocks=24, max_num_seqs=4, max_num_batched_tokens=256)
    assert layout(eng) == "kv_pairs"
    hf = copy.deepcopy(model).to(BF16)
    batch = prompts(40, 44, 36, 50, start=11)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    cold = eng.generate(batch, params)
    again = eng.generate(batch, params)
    assert sum(r.num_cached_tokens for r in again) > 0
    for results in (cold, again):
        assert_agrees_teacher_forced(hf, batch, results)
    eng.tiers.close()


@needs_pairs
def test_disk_files_are_position_major_so_any_order_loads_them(tmp_path: Path,
                                                               monkeypatch) -> None:
    """A warm restart across orders: a worker with K in pairs writes its prefix's blocks, one
    with K and V position-major loads them from the same folder (and writes its own), and one
    with K and V in pairs (AMX tiles; K in pairs where the CPU has none) loads those; every
    load a hit, every answer the referee's."""
    model = write_checkpoint(tmp_path / "llama", "llama", heads=2)
    hf = copy.deepcopy(model).to(BF16)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    first, second = prompts(48, start=5), prompts(48, start=77)
    writer = None
    last = ("amx", "kv_pairs") if KERNEL.amx_tiles else ("pairs", "k_pairs")
    for (scores, order), reads, writes in [(("pairs", "k_pairs"), None, first),
                                           (("lanes", "rows"), first, second),
                                           (last, second, None)]:
        if writer is not None:
            writer.tiers.close()  # the dead worker's folder is free for the next
        eng = pinned_engine(tmp_path / "llama", tmp_path / "disk", scores, monkeypatch)
        assert layout(eng) == order
        if reads is not None:
            loaded = eng.generate(reads, params)
            assert loaded[0].num_cached_tokens == 32  # the full blocks before the last token
            assert eng.stats().external_tokens_hit == 32
            assert_agrees_teacher_forced(hf, reads, loaded)
        if writes is not None:
            eng.generate(writes, params)
            eng.tiers.disk.flush()
            eng.tiers.poll()
        writer = eng
    writer.tiers.close()
