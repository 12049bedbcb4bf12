"""KV tiers below the pool (workers/kv_tiers): host memory and a disk folder, on real files.

Greedy tokens after a prefix came back from the host tier or from disk equal transformers' and
a cold engine's, through chunked prefill, preemption and n > 1 forks; every copy that fails a
check is a counted miss; the tiers keep their invariants (one cached block wherever its copies
are, LRU order, no leaked slot or file, the disk cap) and a new engine on the same folder finds
the blocks again (a warm restart).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_engine import hf_greedy, prompts, write_checkpoint

from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.events import DISK, HOST, BlockRemoved, BlockStored
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig, GenerateOutput
from prefixserve.workers.errors import StepFailedError
from prefixserve.workers.kv_cache import KVCacheManager
from prefixserve.workers.kv_tiers import offload
from prefixserve.workers.kv_tiers.block_io import BlockIO
from prefixserve.workers.kv_tiers.disk import DiskTier
from prefixserve.workers.kv_tiers.disk_format import HEADER, file_name, layout_key
from prefixserve.workers.kv_tiers.host import HostTier
from prefixserve.workers.kv_tiers.offload import TieredKV
from prefixserve.workers.scheduler import SeqStatus

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCK = 4
POOL = 24  # blocks: two 40-token prompts do not fit together with their outputs


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama")
    return path, write_checkpoint(path, "llama")


def block_bytes(eng: LLMEngine) -> int:
    return eng.kv_cache[:, :, 0].numel() * eng.kv_cache.element_size()


def engine(path: Path, *, host_blocks: int = 0, disk: Path | None = None,
           disk_blocks: int = 1000, **kw) -> LLMEngine:
    """An engine whose tiers hold `host_blocks` and `disk_blocks` blocks."""
    per_block = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x K/V x tokens x kv heads x head_dim x fp32
    kw.setdefault("num_blocks", POOL)
    cfg = EngineConfig(device="cpu", block_size=BLOCK, kv_offloading_size=host_blocks
                       * per_block / 2**30, kv_disk_dir=None if disk is None else str(disk),
                       kv_disk_size=disk_blocks * (per_block + HEADER.size) / 2**30, **kw)
    eng = LLMEngine.from_pretrained(path, cfg)
    assert block_bytes(eng) == per_block
    return eng


def flood(eng: LLMEngine, n: int = 6, start: int = 50) -> None:
    """Other prompts, enough to evict everything from the pool."""
    eng.generate(prompts(*[40] * n, start=start), GREEDY)


def landed(tiers: TieredKV) -> None:
    """Let the disk writer finish and the tiers take in its results."""
    tiers.disk.flush()
    tiers.poll()


def settle(eng: LLMEngine) -> None:
    """The same for an engine's tiers, if it has a disk tier."""
    if eng.tiers is not None and eng.tiers.disk is not None:
        landed(eng.tiers)


def gate_reads(eng: LLMEngine) -> threading.Event:
    """Make the disk tier's reads wait until the returned event is set."""
    gate = threading.Event()
    read = eng.tiers.disk._read_many
    eng.tiers.disk._read_many = lambda hashes: (gate.wait(30), read(hashes))[1]
    return gate


def only_on_disk(eng: LLMEngine, prompt: list[int], n: int = 6) -> GenerateOutput:
    """Serve ``prompt``, then evict its blocks from the pool (``n`` other prompts): they are
    on disk only, written. Returns the first serving's output."""
    (out,) = eng.generate([prompt], GREEDY)
    settle(eng)
    flood(eng, n)
    settle(eng)
    return out


def cached_by_a_dead_worker(path: Path, folder: Path, start: int) -> tuple[LLMEngine, list[int]]:
    """An engine that served a 41-token prompt with a disk tier in ``folder``, its writes
    landed, then died (its folder's lock went with it); the engine and the prompt."""
    first = engine(path, disk=folder)
    (p,) = prompts(41, start=start)
    first.generate([p], GREEDY)
    settle(first)
    first.tiers.close()
    return first, p


def test_a_prefix_evicted_to_host_comes_back_exact(llama) -> None:
    path, model = llama
    eng = engine(path, host_blocks=64)
    (p,) = prompts(41)
    (cold,) = eng.generate([p], GREEDY)
    assert cold.num_cached_tokens == 0
    flood(eng)
    assert eng.kv.computed_blocks(hashes_of(eng, p), len(p)) == []  # gone from the pool
    (warm,) = eng.generate([p], GREEDY)
    assert warm.num_cached_tokens == 40  # every full block but the last token's
    assert warm.samples[0].token_ids == cold.samples[0].token_ids == hf_greedy(model, p, 6)
    s = eng.stats()
    assert s.external_tokens_hit == 40 and s.tiers.loaded_bytes[HOST] == 10 * block_bytes(eng)
    assert s.tiers.offloaded_bytes[HOST] > 0 and not s.tiers.load_failures
    # vLLM's prefix_cache_* count the pool's hits alone, external_prefix_cache_* the tiers'
    assert s.prompt_tokens_hit == 0 and s.external_tokens_queried == 41 + 6 * 40 + 41
    assert eng.kv.num_free_blocks == POOL


def hashes_of(eng: LLMEngine, prompt: list[int]) -> list[bytes]:
    return hash_chain(prompt, BLOCK, namespace(eng.model_fingerprint))


def test_a_prefix_on_disk_comes_back_exact_under_chunked_prefill_and_forks(llama, tmp_path):
    path, model = llama
    eng = engine(path, disk=tmp_path, max_num_batched_tokens=12)
    (p,) = prompts(37, start=9)
    cold = only_on_disk(eng, p)
    assert eng.kv.computed_blocks(hashes_of(eng, p), len(p)) == []
    before = eng.stats()
    forks = SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True)
    (warm,) = eng.generate([p], forks)
    assert warm.num_cached_tokens == 36
    expected = hf_greedy(model, p, 6)
    assert cold.samples[0].token_ids == expected
    assert [s.token_ids for s in warm.samples] == [expected] * 3
    s = eng.stats()
    loaded = s.tiers.loaded_bytes[DISK] - before.tiers.loaded_bytes.get(DISK, 0)
    assert loaded == 9 * block_bytes(eng)
    assert s.external_tokens_hit - before.external_tokens_hit == 36
    assert eng.kv.num_free_blocks == POOL and not eng.scheduler.loading
    eng.tiers.close()


def test_preemption_with_tiers_matches_transformers(llama, tmp_path) -> None:
    path, model = llama
    eng = engine(path, host_blocks=8, disk=tmp_path, num_blocks=14, max_num_seqs=8)
    batch = prompts(12, 13, 14, 15, start=21)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second round finds the first's blocks in the tiers
        results = eng.generate(batch, params)
        settle(eng)
        for p, r in zip(batch, results, strict=True):
            assert r.samples[0].token_ids == hf_greedy(model, p, 16)
    s = eng.stats()
    assert s.num_preemptions > 0 and s.external_tokens_hit > 0
    assert eng.kv.num_free_blocks == 14
    eng.tiers.close()


def test_offload_once_and_one_cached_block(llama) -> None:
    path, _ = llama
    eng = engine(path, host_blocks=64)
    host = eng.tiers.host
    puts: list[bytes] = []
    put = host.put
    host.put = lambda h: (puts.append(h), put(h))[1]  # record every copy into the tier
    (p,) = prompts(41, start=3)
    chain = hashes_of(eng, p)[:11]  # 47 tokens: 11 full blocks
    eng.generate([p], GREEDY)
    flood(eng, n=3)
    assert all(h in host and eng.tiers.medium(h) == HOST for h in chain)
    eng.generate([p], GREEDY)  # back in the pool and still in the host tier: one cached block
    assert all(eng.tiers.medium(h) == "device" and h in host for h in chain[:10])
    assert sorted(eng.cached_block_hashes()) == sorted(set(eng.cached_block_hashes()))
    flood(eng, n=3, start=60)  # evicted again: the host copies are only touched
    assert all(h in host for h in chain)
    assert sorted(h for h in puts if h in set(chain)) == sorted(chain)  # each copied once
    # blocks the host tier holds (p's), then blocks it does not (q's), evicted together: q's
    # are copied all the same
    eng.generate([p], GREEDY)
    (q,) = prompts(41, start=5)
    eng.generate([q], GREEDY)
    flood(eng, n=3, start=70)
    assert all(h in host for h in hashes_of(eng, q)[:10])
    assert len(host.slots) + len(host._free) == host.num_slots  # no slot leaks


def test_host_tier_evicts_least_recently_used_first() -> None:
    host = HostTier(2, (2, 3), torch.float32)
    host.put(b"a").fill_(1.0)
    host.put(b"b").fill_(2.0)
    host.touch(b"a")
    victim, data = host.evict_lru()
    assert victim == b"b" and data.eq(2.0).all()
    assert host.evict_lru() is None  # a slot is free now
    host.put(b"c")
    assert list(host.slots) == [b"a", b"c"] and host.get(b"a").eq(1.0).all()


def test_host_tier_sizes_and_types_its_slots() -> None:
    one = HostTier(1, (2, 3), torch.bfloat16)  # one slot is a tier
    assert one.data.shape == (1, 2, 3) and one.data.dtype == torch.bfloat16
    one.put(b"a")
    assert one.evict_lru()[0] == b"a"
    assert HostTier(3).data is None  # the simulator's: which hash is where, no contents
    with pytest.raises(ValueError, match=r"^the host tier needs at least one block slot$"):
        HostTier(0)


def test_events_report_the_best_tier_and_removal_only_when_no_tier_holds_it(llama) -> None:
    path, _ = llama
    events = []
    eng = engine(path, host_blocks=4)
    eng.on_kv_events = events.extend
    (p,) = prompts(41, start=5)
    eng.generate([p], GREEDY)
    events.clear()
    flood(eng, n=4)
    to_host = {h for e in events if isinstance(e, BlockStored) and e.medium == HOST
               for h in e.hashes}
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.hashes}
    chain = set(hashes_of(eng, p))
    assert chain & to_host, "evicted blocks are reported stored in the host tier"
    assert chain & removed, "a 4-block host tier drops most of them: removed"
    for h in chain & removed:
        assert eng.tiers.medium(h) is None
    # a block still held somewhere is never reported removed after its last store
    last: dict[bytes, object] = {}
    for e in events:
        for h in getattr(e, "hashes", ()):
            last[h] = e
    for h, e in last.items():
        assert isinstance(e, BlockRemoved) == (eng.tiers.medium(h) is None)


def corrupt(folder: Path, h: bytes, how: str) -> None:
    f = folder / file_name(h)
    if how == "deleted":
        f.unlink()
    elif how == "truncated":
        os.truncate(f, f.stat().st_size - 7)
    else:
        raw = bytearray(f.read_bytes())
        raw[HEADER.size + 5] ^= 0xFF
        f.write_bytes(bytes(raw))


@pytest.mark.parametrize(("how", "reason"), [("deleted", "missing"),
                                             ("truncated", "truncated"),
                                             ("flipped", "checksum")])
def test_a_bad_file_is_a_counted_miss_never_wrong_kv(llama, tmp_path, how, reason) -> None:
    path, model = llama
    eng = engine(path, disk=tmp_path)
    (p,) = prompts(41, start=11)
    only_on_disk(eng, p)
    chain = hashes_of(eng, p)
    corrupt(eng.tiers.disk.folder, chain[4], how)
    events = []
    eng.on_kv_events = events.extend
    (warm,) = eng.generate([p], GREEDY)
    assert warm.samples[0].token_ids == hf_greedy(model, p, 6)
    assert warm.num_cached_tokens == 4 * BLOCK  # the blocks before the bad one
    s = eng.stats()
    assert s.tiers.load_failures == {reason: 1}
    assert s.tiers.loaded_bytes == {DISK: 4 * block_bytes(eng)}
    assert BlockRemoved((chain[4],)) in events  # held nowhere until recomputed
    # the recomputed block was committed again, and written again: whole now
    settle(eng)
    assert eng.tiers.disk.readable(chain[4])
    assert eng.kv.num_free_blocks == POOL
    flood(eng, start=70)
    settle(eng)
    (again,) = eng.generate([p], GREEDY)
    assert again.num_cached_tokens == 40 and eng.stats().tiers.load_failures == {reason: 1}
    eng.tiers.close()


def test_a_full_disk_means_no_offload_and_serving_goes_on(llama, tmp_path) -> None:
    path, model = llama
    eng = engine(path, disk=tmp_path)
    eng.tiers.disk.min_free_bytes = 1 << 62  # more than any disk has free
    (p,) = prompts(41, start=12)
    (res,) = eng.generate([p], GREEDY)
    settle(eng)
    assert res.samples[0].token_ids == hf_greedy(model, p, 6)
    assert eng.stats().tiers.store_skips["disk_full"] == 11  # 47 tokens: 11 full blocks
    assert not list(eng.tiers.disk.folder.glob("*.kv")) and not eng.tiers.disk.files
    eng.tiers.close()


def test_the_disk_cap_holds_lru_first(llama, tmp_path) -> None:
    path, _ = llama
    eng = engine(path, disk=tmp_path, disk_blocks=15)
    eng.generate(prompts(41, 41, start=13), GREEDY)
    settle(eng)
    disk = eng.tiers.disk
    files = list(disk.folder.glob("*.kv"))
    assert len(files) == len(disk.files) == 15
    assert disk.used_bytes == sum(f.stat().st_size for f in files) <= disk.capacity_bytes
    eng.tiers.close()


def test_warm_restart_on_the_same_folder(llama, tmp_path) -> None:
    path, model = llama
    first, p = cached_by_a_dead_worker(path, tmp_path, start=14)
    events = []
    second = engine(path, disk=tmp_path)
    assert second.tiers.disk.folder == first.tiers.disk.folder
    second.on_kv_events = events.extend
    assert set(hashes_of(second, p)[:10]) <= set(second.cached_block_hashes())
    (warm,) = second.generate([p], GREEDY)
    assert warm.num_cached_tokens == 40
    assert warm.samples[0].token_ids == hf_greedy(model, p, 6)
    announced = {h for e in events if isinstance(e, BlockStored) and e.medium == DISK
                 for h in e.hashes}
    assert set(hashes_of(second, p)[:10]) <= announced
    # a second live engine on the folder gets a folder of its own
    third = engine(path, disk=tmp_path)
    assert third.tiers.disk.folder != second.tiers.disk.folder and not third.tiers.disk.files
    second.tiers.close()
    third.tiers.close()


def test_another_models_folder_is_ignored_with_one_log_line(llama, tmp_path, caplog) -> None:
    path, _ = llama
    first, _ = cached_by_a_dead_worker(path, tmp_path, start=15)
    other = tmp_path / "other-model"
    write_checkpoint(other, "qwen2")
    with caplog.at_level(logging.INFO, logger="prefixserve.workers.kv_tiers.disk"):
        eng = LLMEngine.from_pretrained(other, EngineConfig(
            device="cpu", block_size=BLOCK, num_blocks=POOL, kv_disk_dir=str(tmp_path)))
    assert not eng.tiers.disk.files and eng.stats().tiers.load_failures == {}
    lines = [r.getMessage() for r in caplog.records if "other models" in r.getMessage()]
    assert len(lines) == 1 and first.tiers.disk.folder.parent.name in lines[0]
    # a file of another layout dropped into this worker's folder is never loaded
    foreign = next(first.tiers.disk.folder.glob("*.kv"))
    (eng.tiers.disk.folder / foreign.name).write_bytes(foreign.read_bytes())
    eng.tiers.close()
    again = LLMEngine.from_pretrained(other, EngineConfig(
        device="cpu", block_size=BLOCK, num_blocks=POOL, kv_disk_dir=str(tmp_path)))
    assert not again.tiers.disk.files
    again.tiers.close()


def test_a_write_cut_short_leaves_nothing_that_loads(llama, tmp_path) -> None:
    path, model = llama
    first, p = cached_by_a_dead_worker(path, tmp_path, start=16)
    folder = first.tiers.disk.folder
    chain = hashes_of(first, p)
    # a writer killed mid-write: a partial temporary file, and (as if the disk lied) a
    # renamed file cut short
    (folder / f".{file_name(chain[2])}.123.tmp").write_bytes(b"partial")
    os.truncate(folder / file_name(chain[3]), HEADER.size + 10)
    eng = engine(path, disk=tmp_path)
    assert not list(folder.glob("*.tmp")) and not eng.tiers.disk.readable(chain[3])
    (warm,) = eng.generate([p], GREEDY)
    assert warm.samples[0].token_ids == hf_greedy(model, p, 6)
    assert warm.num_cached_tokens == 3 * BLOCK
    eng.tiers.close()


def test_abort_while_loading_frees_everything(llama, tmp_path) -> None:
    path, _ = llama
    eng = engine(path, disk=tmp_path)
    (p,) = prompts(41, start=17)
    only_on_disk(eng, p)
    eng.add_request("r", p, GREEDY)
    eng.step()
    assert "r#0" in eng.scheduler.loading
    eng.abort("r")
    while eng.has_unfinished():
        eng.step()
    assert not eng.scheduler.loading and not eng.tiers.jobs and not eng.kv.held
    assert eng.kv.num_free_blocks == POOL
    eng.tiers.close()


def test_reset_clears_every_tier(llama, tmp_path) -> None:
    path, _ = llama
    eng = engine(path, host_blocks=16, disk=tmp_path)
    eng.generate(prompts(41, start=18), GREEDY)
    flood(eng, n=3)
    settle(eng)
    assert len(eng.tiers.host) > 0 and eng.tiers.disk.files
    eng.reset_prefix_cache()
    settle(eng)
    assert not eng.cached_block_hashes() and not list(eng.tiers.disk.folder.glob("*.kv"))
    assert len(eng.tiers.host) == 0 and not eng.tiers.disk.files
    eng.tiers.close()


def test_running_sequences_take_back_blocks_held_for_a_load(llama, tmp_path) -> None:
    """A sequence waiting on a slow disk read holds pool blocks; a running one that needs
    them gets them (the load starts over later), instead of being cut short as too long."""
    path, model = llama
    eng = engine(path, disk=tmp_path, num_blocks=14)
    p, q = prompts(40, 20, start=30)
    only_on_disk(eng, p, n=2)
    gate = gate_reads(eng)
    reads = count_reads(eng)
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # 50 tokens: 13 blocks
    eng.add_request("q", q, long)
    outs: dict[str, list[int]] = {"p": [], "q": eng.step()[0].new_token_ids}
    eng.add_request("p", p, GREEDY)
    reasons = {}
    held_while_q_ran = False
    while "q" not in reasons:
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        held_while_q_ran |= bool(eng.kv.held)
    assert held_while_q_ran and "p" not in reasons  # p was loading all along
    assert outs["q"] == hf_greedy(model, q, 30) and reasons["q"] == "length"
    gate.set()
    cached = 0
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            cached = o.num_cached_tokens if o.request_id == "p" else cached
    assert outs["p"] == hf_greedy(model, p, 6)
    # it searched the tiers again at its turn, loaded the one block there was room for, and
    # searched again as q gave blocks back: all of it but the block of its last token
    assert cached == 9 * BLOCK
    assert reads == [8, 7, 6, 5, 4, 3, 2, 1, 8]  # each time q took a block back, one less
    assert eng.kv.num_free_blocks == 14 and not eng.kv.held
    eng.tiers.close()


def test_a_preempted_sequence_finds_its_evicted_blocks_in_the_host_tier(llama) -> None:
    """b is preempted (the newest running sequence) while a grows. Kept waiting until a is done
    (one sequence at a time from then on), it sees a take its freed blocks, which go to the
    host tier. At its next turn b searches the tiers again and loads them, not recomputes them."""
    path, model = llama
    eng = engine(path, host_blocks=64, num_blocks=14)
    a, b = prompts(16, 24, start=70)
    eng.add_request("a", a, SamplingParams(max_tokens=38, temperature=0, ignore_eos=True))
    outs: dict[str, list[int]] = {"a": eng.step()[0].new_token_ids, "b": []}
    eng.add_request("b", b, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    loaded = eng.tiers.counters.loaded_bytes
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
        if eng.stats().num_preemptions:
            eng.scheduler.max_num_seqs = 1
    assert outs == {"a": hf_greedy(model, a, 38), "b": hf_greedy(model, b, 10)}
    assert eng.stats().num_preemptions == 1
    assert loaded == {"host": 7 * block_bytes(eng)}  # all of b but the block of its last token
    assert eng.kv.num_free_blocks == 14
    eng.tiers.close()


def test_tier_counters_and_rates_are_exact(llama) -> None:
    """What the engine reports of its host tier: bytes offloaded (each evicted block once),
    bytes loaded, the load rate in tokens a second from those counters, the tier's usage, and
    every hash it holds."""
    path, _ = llama
    eng = engine(path, host_blocks=32)
    host = eng.tiers.host
    puts: list[bytes] = []
    put = host.put
    host.put = lambda h: (puts.append(h), put(h))[1]
    (p,) = prompts(41, start=23)
    eng.generate([p], GREEDY)
    flood(eng, n=2)
    s = eng.stats()
    size = block_bytes(eng)
    assert s.tiers.offloaded_bytes[HOST] == len(puts) * size and len(puts) > 10
    assert s.tiers.host_usage == len(host) / host.num_slots == len(host) / 32
    assert 0 < s.tiers.host_usage < 1
    assert sorted(eng.tiers.hashes()) == sorted(host.slots)
    assert s.host_load_tokens_per_s == 0.0  # nothing loaded yet
    (warm,) = eng.generate([p], GREEDY)
    assert warm.num_cached_tokens == 40
    s = eng.stats()
    assert s.tiers.loaded_bytes[HOST] == 10 * size
    rate = 10 * BLOCK / s.tiers.load_s[HOST]
    assert s.host_load_tokens_per_s == pytest.approx(rate, rel=1e-9)
    assert s.disk_load_tokens_per_s == 0.0


def test_where_a_block_is(llama, tmp_path) -> None:
    """`medium`: the pool's copy first, then the host tier's, then the disk's; None when no
    tier holds the block. Cancelling a load that does not exist is a no-op."""
    path, _ = llama
    eng = engine(path, host_blocks=2, disk=tmp_path)
    (p,) = prompts(41, start=29)
    chain = hashes_of(eng, p)[:10]
    eng.generate([p], GREEDY)
    settle(eng)
    assert all(eng.tiers.medium(h) == "device" for h in chain)
    flood(eng)
    settle(eng)
    media = [eng.tiers.medium(h) for h in chain]
    assert DISK in media and all(m in (HOST, DISK) for m in media)
    assert all((m == HOST) == (h in eng.tiers.host) for h, m in zip(chain, media, strict=True))
    assert eng.tiers.medium(b"\0" * 16) is None
    below = set(eng.tiers.hashes())
    assert set(chain) <= below and set(eng.tiers.host.slots) <= below
    eng.tiers.cancel("no-such-sequence")
    eng.tiers.close()


class TickingClock:
    """`time` for the tiers' module: every `perf_counter()` reads one second later, so each
    timed span is exactly the clock reads it takes."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_tier_times_add_up_over_offloads_and_loads(llama, monkeypatch) -> None:
    """Offload and load seconds accumulate, one span per offload and per load."""
    monkeypatch.setattr(offload, "time", TickingClock())
    path, _ = llama
    eng = engine(path, host_blocks=64)
    offloads: list[int] = []
    count = eng.tiers._count_offload
    eng.tiers._count_offload = lambda m, n, s: (offloads.append(n), count(m, n, s))[1]
    (p,) = prompts(41, start=31)
    for _ in range(2):
        eng.generate([p], GREEDY)
        flood(eng, n=2, start=80 + len(offloads))
    (warm,) = eng.generate([p], GREEDY)
    flood(eng, n=2, start=90)
    (again,) = eng.generate([p], GREEDY)
    assert warm.num_cached_tokens == again.num_cached_tokens == 40
    t = eng.stats().tiers
    assert t.offload_s[HOST] == len(offloads) >= 3  # one tick a span: none overwritten
    assert t.offloaded_bytes[HOST] == sum(offloads) * block_bytes(eng)
    assert t.load_s[HOST] == 3.0 and t.loaded_bytes[HOST] == 30 * block_bytes(eng)  # 3 loads
    assert eng.stats().host_load_tokens_per_s == 30 * BLOCK / 3.0


def test_a_failed_disk_reader_is_a_counted_miss(llama, tmp_path) -> None:
    """The reader itself failing (not one file) is a `read_error` miss of every block it was
    to read, recomputed; a disk-only engine reports no host usage and counts what it wrote."""
    path, model = llama
    eng = engine(path, disk=tmp_path)
    (p,) = prompts(41, start=33)
    only_on_disk(eng, p)
    s = eng.stats()
    assert s.tiers.host_usage == 0.0
    assert s.tiers.offloaded_bytes[DISK] == len(eng.tiers.disk.files) * block_bytes(eng)

    def failing(hashes):
        future = concurrent.futures.Future()
        future.set_exception(OSError("the reader died"))
        return future

    eng.tiers.disk.read_many = failing
    for _ in range(2):
        before = eng.stats().tiers.load_failures.get("read_error", 0)
        (res,) = eng.generate([p], GREEDY)
        assert res.num_cached_tokens == 0 and res.samples[0].token_ids == hf_greedy(model, p, 6)
        assert eng.stats().tiers.load_failures == {"read_error": before + 1}
        # six prompts whose loads all fail at once: the blocks held for them fill the pool,
        # and with nothing running they are let go (they were held forever)
        flood(eng)
        settle(eng)
    assert eng.kv.num_free_blocks == POOL and not eng.tiers.jobs and not eng.kv.held
    eng.tiers.close()


def test_modelled_load_rates_are_reported_as_given() -> None:
    """The simulator's tiers keep bookkeeping only and report the rates they were given."""
    tiers = TieredKV(KVCacheManager(8, BLOCK), None, HostTier(3), None, 64,
                     rates={HOST: 5.0, DISK: 0.5})
    assert tiers.load_rates() == {"host_load_tokens_per_s": 5.0, "disk_load_tokens_per_s": 0.5}


# --------------------------------------------------------------- the tiers' paths one by one
A, B, C, D = (c * 16 for c in (b"a", b"b", b"c", b"d"))  # block hashes are 16 bytes


def small_tiers(folder: Path, *, disk_files: int, host_slots: int = 0,
                num_blocks: int = 4) -> TieredKV:
    """Tiers over a 4-block pool of random KV, a disk tier holding `disk_files` blocks."""
    io = BlockIO(torch.randn(1, 2, num_blocks, BLOCK, 1, 2))
    key, layout = layout_key("small", BLOCK, "float32", io.block_shape)
    disk = DiskTier(folder, key, layout, io.block_shape, io.dtype,
                    disk_files * (HEADER.size + io.block_bytes), min_free_bytes=0)
    host = HostTier(host_slots, io.block_shape, io.dtype) if host_slots else None
    return TieredKV(KVCacheManager(num_blocks, BLOCK), io, host, disk, io.block_bytes)


def computed(tiers: TieredKV, hashes: list[bytes]) -> list:
    """Blocks hashed and committed (their KV written) by a step; still referenced."""
    blocks = tiers.pool.allocate(len(hashes))
    tiers.pool.cache(blocks, hashes)
    tiers.pool.commit()
    return blocks


def test_an_evicted_block_already_on_disk_is_touched_there(tmp_path) -> None:
    """A block the pool evicts that the disk tier holds is used now on disk: the disk's next
    eviction takes the one written after it."""
    tiers = small_tiers(tmp_path, disk_files=3)
    a, b, _ = computed(tiers, [A, B, C])
    landed(tiers)
    assert list(tiers.disk.files) == [A, B, C]
    tiers.pool.release([a])
    tiers.pool.allocate(2)  # the empty block, then a: evicted
    assert list(tiers.disk.files) == [B, C, A]
    tiers.pool.release([b])
    computed(tiers, [D])  # evicts b from the pool (touched on disk), then d is written
    landed(tiers)
    assert list(tiers.disk.files) == [A, B, D]  # c, the least recently used, went
    tiers.close()


def test_a_block_the_disk_drops_that_the_host_holds_is_not_reported_again(tmp_path) -> None:
    tiers = small_tiers(tmp_path, disk_files=1, host_slots=2)
    (a,) = computed(tiers, [A])
    landed(tiers)
    tiers.pool.release([a])
    tiers.pool.allocate(4)  # a is evicted to the host tier
    assert tiers.medium(A) == HOST and tiers.pool.events[-1] == BlockStored((A,), HOST)
    tiers.pool.events.clear()
    tiers.pool.release(tiers.pool.blocks)
    computed(tiers, [B])  # the disk makes room for b: a's file goes, its host copy stays
    landed(tiers)
    assert list(tiers.disk.files) == [B] and tiers.medium(A) == HOST
    assert tiers.pool.events == [BlockStored((B,), "device")]
    tiers.close()


def on_disk(tiers: TieredKV, block_hash: bytes) -> torch.Tensor:
    (data,) = tiers.disk.read_many([block_hash]).result()
    return data


def test_blocks_the_disk_missed_are_written_when_they_leave_the_pool_or_the_host(
        tmp_path) -> None:
    """Write-behind skipped them (the disk was full); once there is room, a block the pool
    evicts with no host tier, and a host tier's victim, are written then, their own KV."""
    alone = small_tiers(tmp_path / "alone", disk_files=4)
    alone.disk.min_free_bytes = 1 << 62
    (a,) = computed(alone, [A])
    assert alone.counters.store_skips == {"disk_full": 1}
    alone.disk.min_free_bytes = 0
    alone.pool.release([a])
    alone.pool.allocate(4)  # a is evicted last
    landed(alone)
    assert list(alone.disk.files) == [A]
    assert on_disk(alone, A).equal(alone.io.kv_cache[:, :, a.block_id])
    alone.close()

    both = small_tiers(tmp_path / "both", disk_files=4, host_slots=1)
    both.disk.min_free_bytes = 1 << 62
    a, b = computed(both, [A, B])
    both.disk.min_free_bytes = 0
    both.pool.release([b, a])
    both.pool.allocate(4)  # b, then a evicted: b to the host, then spilled for a
    landed(both)
    assert list(both.host.slots) == [A] and list(both.disk.files) == [B]
    assert on_disk(both, B).equal(both.io.kv_cache[:, :, b.block_id])
    assert both.counters.store_skips == {"disk_full": 2}
    both.close()


def test_a_write_skipped_for_a_full_disk_evicts_nothing(tmp_path) -> None:
    """The tier's cap is full and the disk has no room to spare: the new block is skipped as
    disk_full, and the files the cap would have evicted for it stay."""
    tiers = small_tiers(tmp_path, disk_files=2)
    computed(tiers, [A, B])
    landed(tiers)
    assert list(tiers.disk.files) == [A, B]
    tiers.disk.min_free_bytes = 1 << 62
    computed(tiers, [C])
    landed(tiers)
    assert tiers.counters.store_skips == {"disk_full": 1}
    assert list(tiers.disk.files) == [A, B] and tiers.disk.evicted == []
    assert sorted(p.name for p in tiers.disk.folder.glob("*.kv")) == sorted(
        file_name(h) for h in (A, B))
    tiers.close()


def test_failed_disk_writes_are_counted_and_reported_removed_where_nothing_holds_them(
        tmp_path) -> None:
    tiers = small_tiers(tmp_path, disk_files=4)
    shutil.rmtree(tiers.disk.folder)
    tiers.disk.folder.write_bytes(b"")  # a file in its place: every write fails on the writer
    gate = threading.Event()
    tiers.disk._writer.submit(gate.wait, 30)  # the writes wait until both blocks are queued
    a, _ = computed(tiers, [A, B])
    tiers.pool.release([a])
    tiers.pool.allocate(3)  # the empty blocks, then a: evicted, its write still queued
    tiers.pool.events.clear()
    gate.set()
    landed(tiers)
    assert tiers.counters.store_skips == {"write_error": 2}
    # a is held nowhere now; b is still in the pool
    assert tiers.pool.events == [BlockRemoved((A,))]
    assert tiers.medium(B) == "device" and not tiers.disk.files and not tiers.disk.pending
    tiers.close()


def test_a_vanished_disk_folder_skips_the_write_and_serving_goes_on(llama, tmp_path) -> None:
    path, model = llama
    eng = engine(path, disk=tmp_path)
    shutil.rmtree(eng.tiers.disk.folder)
    (p,) = prompts(41, start=19)
    (res,) = eng.generate([p], GREEDY)
    assert res.samples[0].token_ids == hf_greedy(model, p, 6)
    assert eng.stats().tiers.store_skips == {"write_error": 11}  # 47 tokens: 11 full blocks
    eng.tiers.close()


def test_a_prefix_half_in_the_pool_half_in_the_host_tier_comes_back_exact(llama) -> None:
    """The pool evicts a chain's tail first: the head is a pool hit, the tail loads from the
    host tier, and the walk stops at the first block held nowhere (no disk tier to ask)."""
    path, model = llama
    eng = engine(path, host_blocks=64)
    (p,) = prompts(41, start=23)
    eng.generate([p], GREEDY)
    eng.generate(prompts(41, 17, start=24), GREEDY)  # evicts p's last few blocks
    where = [eng.tiers.medium(h) for h in hashes_of(eng, p)[:10]]
    assert where == ["device"] * 6 + [HOST] * 4
    longer = p + prompts(9, start=25)[0]  # two full blocks beyond what any tier holds
    before = eng.stats()
    (warm,) = eng.generate([longer], GREEDY)
    assert warm.samples[0].token_ids == hf_greedy(model, longer, 6)
    assert warm.num_cached_tokens == 40
    s = eng.stats()
    assert s.prompt_tokens_hit - before.prompt_tokens_hit == where.count("device") * BLOCK
    assert s.tiers.loaded_bytes[HOST] == where.count(HOST) * block_bytes(eng)
    # the tiers are asked for what the pool lacks, and had 4 of its blocks
    assert s.external_tokens_queried - before.external_tokens_queried == len(longer) - 6 * BLOCK
    assert s.external_tokens_hit - before.external_tokens_hit == 4 * BLOCK
    assert eng.kv.num_free_blocks == POOL and not eng.kv.held


def test_loads_begun_before_a_reset_are_dropped_and_later_ones_kept(llama, tmp_path) -> None:
    """Three sequences wait on disk reads: one asked before each of two resets and one after
    both. When the reads land together, only the last one's blocks are loaded; the others
    recompute (the KV they read was cleared)."""
    path, model = llama
    eng = engine(path, disk=tmp_path, num_blocks=64)  # room for all three to wait
    gate = gate_reads(eng)
    batch = prompts(41, 41, 41, start=27)
    for i, p in enumerate(batch):
        eng.generate([p], GREEDY)
        for k in range(5):  # one at a time: the waiting ones keep their blocks
            eng.generate(prompts(41, start=60 + 10 * i + k), GREEDY)
        settle(eng)
        eng.add_request(f"r{i}", p, GREEDY)
        eng.step()
        if i < 2:
            eng.reset_prefix_cache()
    assert list(eng.scheduler.loading) == ["r0#0", "r1#0", "r2#0"]
    gate.set()
    concurrent.futures.wait([j.future for j in eng.tiers.jobs.values()])
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    cached = {}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
    assert cached == {"r0": 0, "r1": 0, "r2": 40}
    assert not eng.stats().tiers.load_failures  # dropped unread, not failed (files deleted)
    assert [tokens[f"r{i}"] for i in range(3)] == [hf_greedy(model, p, 6) for p in batch]
    assert not eng.tiers.jobs and not eng.kv.held and eng.kv.num_free_blocks == 64
    eng.tiers.close()


def test_a_failed_step_drops_a_loading_request_and_its_blocks(llama, tmp_path) -> None:
    path, model = llama
    eng = engine(path, disk=tmp_path)
    (p,) = prompts(41, start=28)
    only_on_disk(eng, p)
    gate = gate_reads(eng)
    eng.add_request("r", p, GREEDY)
    eng.step()
    assert "r#0" in eng.scheduler.loading and eng.kv.held
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: 1 / 0  # scheduling itself fails: every request goes
    with pytest.raises(StepFailedError) as failed:
        eng.step()
    assert failed.value.request_ids == ("r",)
    eng.scheduler.schedule = schedule
    gate.set()
    assert not eng.scheduler.loading and not eng.tiers.jobs and not eng.kv.held
    assert eng.kv.num_free_blocks == POOL and not eng.has_unfinished()
    (again,) = eng.generate([p], GREEDY)  # the engine goes on, the blocks still on disk
    assert again.num_cached_tokens == 40 and again.samples[0].token_ids == hf_greedy(model, p, 6)
    eng.tiers.close()


def count_reads(eng: LLMEngine) -> list[int]:
    """The disk reads the engine's tiers begin from now on: each one's block count."""
    calls: list[int] = []
    read_many = eng.tiers.disk.read_many
    eng.tiers.disk.read_many = lambda hashes: (calls.append(len(hashes)), read_many(hashes))[1]
    return calls


def test_a_sequence_that_does_not_fit_waits_for_the_running_ones_and_leaves_loads_alone(
        llama, tmp_path) -> None:
    """r runs in 5 of the 14 blocks and p's disk read holds the other 9; a, behind p, needs 6.
    With r running to give blocks back, a waits: p's load keeps its blocks and is read once."""
    path, model = llama
    eng = engine(path, disk=tmp_path, num_blocks=14)
    p, r, a = prompts(40, 17, 24, start=90)
    only_on_disk(eng, p, n=2)
    reads = count_reads(eng)
    eng.add_request("r", r, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs: dict[str, list[int]] = {"r": eng.step()[0].new_token_ids, "p": [], "a": []}
    eng.add_request("p", p, GREEDY)
    eng.add_request("a", a, GREEDY)
    for o in eng.step():
        outs[o.request_id].extend(o.new_token_ids)
    assert set(eng.scheduler.loading) == {"p#0"} and eng.kv.num_free_blocks == 0
    eng.tiers.wait(30)  # p's blocks read before r is done
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
    assert reads == [9]
    assert outs == {"r": hf_greedy(model, r, 3), "p": hf_greedy(model, p, 6),
                    "a": hf_greedy(model, a, 6)}
    assert eng.kv.num_free_blocks == 14 and not eng.kv.held
    eng.tiers.close()


def test_a_sequence_back_from_its_read_waits_for_room_and_can_be_aborted_there(
        llama, tmp_path) -> None:
    """r runs in 5 of the 14 blocks and p's disk read holds the other 9. Once read, p is back
    in the waiting queue (waiting: its last block has no room until r is done); aborted
    there, it leaves the queue and gives its blocks back, and r is served exact."""
    path, model = llama
    eng = engine(path, disk=tmp_path, num_blocks=14)
    p, r = prompts(40, 17, start=150)
    only_on_disk(eng, p, n=2)
    eng.add_request("r", r, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs: dict[str, list[int]] = {"r": eng.step()[0].new_token_ids, "p": []}
    eng.add_request("p", p, GREEDY)
    for o in eng.step():
        outs[o.request_id].extend(o.new_token_ids)
    (seq,) = eng.scheduler.loading.values()
    eng.tiers.wait(30)
    for o in eng.step():  # the read lands: p waits, its blocks held, with r still running
        outs[o.request_id].extend(o.new_token_ids)
    assert seq.status is SeqStatus.WAITING and list(eng.scheduler.waiting) == [seq]
    assert len(eng.kv.held[seq.seq_id]) == 9
    eng.abort("p")
    assert not eng.scheduler.waiting and not eng.kv.held
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.request_id == "p":
                assert o.finish_reason == "abort"
    assert outs["r"] == hf_greedy(model, r, 4) and outs["p"] == []
    assert eng.kv.num_free_blocks == 14
    eng.tiers.close()


def test_a_load_dropped_for_a_running_sequence_leaves_its_sequence_waiting(
        llama, tmp_path) -> None:
    """p's disk read holds 9 of the 14 blocks while r prefills 8 tokens a step; at r's third
    chunk the pool is out of blocks, so p's load is dropped and p waits, searched again at its
    next turn (r's chunk took this step's budget). Aborted there, it leaves the queue; else it
    reads again and both are served exact."""
    path, model = llama
    for abort in (True, False):
        folder = tmp_path / str(abort)
        eng = engine(path, disk=folder, num_blocks=14, max_num_batched_tokens=8)
        p, r = prompts(40, 30, start=170)
        only_on_disk(eng, p, n=2)
        reads = count_reads(eng)
        gate = gate_reads(eng)
        eng.add_request("p", p, GREEDY)
        eng.step()
        (seq,) = eng.scheduler.loading.values()
        eng.add_request("r", r, GREEDY)
        got: dict[str, list[int]] = {"p": [], "r": []}
        for _ in range(3):  # r's chunks: 2 blocks each, then 2 more than the 1 left
            for o in eng.step():
                got[o.request_id].extend(o.new_token_ids)
        assert seq.status is SeqStatus.WAITING and list(eng.scheduler.waiting) == [seq]
        assert not eng.scheduler.loading and not eng.kv.held and not seq.tiers_checked
        gate.set()  # the dropped read lands; nothing takes it
        if abort:
            eng.abort("p")
            assert not eng.scheduler.waiting
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id].extend(o.new_token_ids)
        assert got["r"] == hf_greedy(model, r, 6)
        assert got["p"] == ([] if abort else hf_greedy(model, p, 6))
        # the read begun again once p's turn came (in parts, as r left the pool room)
        assert reads[0] == 9 and (len(reads) == 1) == abort
        assert eng.kv.num_free_blocks == 14 and not eng.kv.held
        eng.tiers.close()


def test_with_nothing_running_held_blocks_go_and_the_loader_searches_again_in_the_step(
        llama, tmp_path) -> None:
    """p's disk read holds 9 of the 14 blocks and a, behind it, needs 6: with nothing running
    to give blocks back, the holds go (else they would be held forever) and p searches the
    tiers again in the same step, its read begun again."""
    path, model = llama
    eng = engine(path, disk=tmp_path, num_blocks=14)
    p, a = prompts(40, 24, start=110)
    only_on_disk(eng, p, n=2)
    reads = count_reads(eng)
    eng.add_request("p", p, GREEDY)
    eng.add_request("a", a, GREEDY)
    outs: dict[str, list[int]] = {"p": [], "a": []}
    for o in eng.step():
        outs[o.request_id].extend(o.new_token_ids)
    assert reads == [9, 9] and set(eng.scheduler.loading) == {"p#0"}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
    assert outs == {"p": hf_greedy(model, p, 6), "a": hf_greedy(model, a, 6)}
    assert eng.kv.num_free_blocks == 14 and not eng.kv.held
    eng.tiers.close()


def test_a_sequence_loads_what_the_pool_has_room_for_and_the_rest_once_there_is_room(
        llama) -> None:
    """p's 9 blocks are in the host tier, and r runs in 10 of the 14 pool blocks. p loads the
    4 there is room for and waits; r needs one of them to grow, so p's holds go (one of its
    blocks is evicted) and its next search, with no room, holds nothing; once r is done p
    searches again and loads the other 6. It is served
    exact with 36 cached tokens: 12 counted as the pool's (its earlier loads were pool hits at
    its last search) and 24 as the host tier's."""
    path, model = llama
    eng = engine(path, host_blocks=64, num_blocks=14)
    p, r = prompts(40, 37, start=130)
    eng.generate([p], GREEDY)
    flood(eng, 3)
    assert all(h in eng.tiers.host for h in hashes_of(eng, p))
    eng.add_request("r", r, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs: dict[str, list[int]] = {"r": eng.step()[0].new_token_ids, "p": []}
    before, loaded = eng.stats(), eng.tiers.counters.loaded_bytes.get("host", 0)
    eng.add_request("p", p, GREEDY)
    for o in eng.step():
        outs[o.request_id].extend(o.new_token_ids)
    (waiting,) = eng.scheduler.waiting
    assert waiting.loaded_blocks == 4 and len(eng.kv.held[waiting.seq_id]) == 4
    cached, held = None, []
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.request_id == "p" and cached is None:
                cached = o.num_cached_tokens
        held.append(len(eng.kv.held.get(waiting.seq_id, ())))
    # r took a block back in the third step: p's holds went, and its search again, with no
    # room in the pool, held nothing
    assert held[:3] == [4, 4, 0]
    assert outs == {"r": hf_greedy(model, r, 6), "p": hf_greedy(model, p, 6)}
    assert cached == 9 * BLOCK
    after = eng.stats()
    assert after.prompt_tokens_hit - before.prompt_tokens_hit == 3 * BLOCK
    assert after.external_tokens_hit - before.external_tokens_hit == 6 * BLOCK
    assert eng.tiers.counters.loaded_bytes["host"] - loaded == 10 * block_bytes(eng)
    assert eng.kv.num_free_blocks == 14 and not eng.kv.held


def test_cached_hits_no_one_uses_are_taken_out_of_the_room_for_loads(llama) -> None:
    """p's first 4 blocks are still cached in the pool, unused, and its next 5 are in the host
    tier; r runs in 10 of the 16 blocks. Of the 6 free blocks 4 are p's hits, so there is room
    to load 2 now (counting the hits as free too would take blocks the pool does not have), and
    the rest once r is done."""
    path, model = llama
    eng = engine(path, host_blocks=64, num_blocks=16)
    p, s, r = prompts(40, 8, 37, start=150)
    eng.generate([p], GREEDY)
    eng.generate([s], GREEDY)  # freed after p's, so evicted after p's tail
    eng.add_request("r", r, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs: dict[str, list[int]] = {"r": eng.step()[0].new_token_ids, "p": []}
    chain = hashes_of(eng, p)[:9]
    assert [h in eng.kv.pool.cached for h in chain] == [True] * 3 + [False] * 6
    assert all(h in eng.tiers.host for h in chain[3:]) and eng.kv.num_free_blocks == 6
    loaded = eng.tiers.counters.loaded_bytes.get("host", 0)
    eng.add_request("p", p, GREEDY)
    for o in eng.step():
        outs[o.request_id].extend(o.new_token_ids)
    (waiting,) = eng.scheduler.waiting
    assert waiting.loaded_blocks == 3 and len(eng.kv.held[waiting.seq_id]) == 6
    cached = None
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.request_id == "p" and cached is None:
                cached = o.num_cached_tokens
    assert outs == {"r": hf_greedy(model, r, 3), "p": hf_greedy(model, p, 6)}
    assert cached == 9 * BLOCK
    assert eng.tiers.counters.loaded_bytes["host"] - loaded == 6 * block_bytes(eng)
    assert eng.kv.num_free_blocks == 16 and not eng.kv.held
