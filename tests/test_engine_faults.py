"""A step that raises leaves the engine exact: no cache entry for KV that was never written, the
index told, the step's requests gone with their blocks, and the engine reusable at once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_kv_cache import BS, admit, chain, check_invariants

from prefixserve.router.blocks import hash_chain
from prefixserve.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.errors import StepFailedError
from prefixserve.workers.kv_cache import KVCacheManager

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [(i * 7 + 3) % 250 for i in range(40)]  # two full blocks and a partial one
SHARED = PROMPT[:32] + [(i * 11) % 250 for i in range(13)]  # same first two blocks


class Recorder:
    """The net block set an index would hold after applying every delivered event."""

    def __init__(self) -> None:
        self.stored: set[bytes] = set()

    def __call__(self, events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.stored.update(event.hashes)
            elif isinstance(event, BlockRemoved):
                self.stored.difference_update(event.hashes)
            elif isinstance(event, AllBlocksCleared):
                self.stored.clear()


def make_engine(on_kv_events: Recorder | None = None, **kw) -> LLMEngine:
    config = EngineConfig(device="cpu", block_size=BLOCK, num_blocks=32, max_model_len=512, **kw)
    return LLMEngine.from_pretrained(ensure_builtin_model(), config, on_kv_events)


def fail_once(engine: LLMEngine, when: Callable[[int], bool]) -> list[int]:
    """Make the runner raise on the first call ``when(call_number)`` accepts (fault injection
    into this test's own engine); returns the list of calls made so far."""
    real = engine.runner.execute
    calls: list[int] = []

    def execute(sched, adapters=None):
        calls.append(len(calls))
        if when(len(calls) - 1) and not getattr(execute, "fired", False):
            execute.fired = True
            raise RuntimeError("injected forward failure")
        return real(sched, adapters)

    engine.runner.execute = execute
    return calls


def tokens(outs) -> list[list[int]]:
    return [o.samples[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def fresh() -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens from an engine that never failed (one per prompt)."""
    return {
        tuple(p): tokens(make_engine().generate([p], GREEDY))[0] for p in (PROMPT, SHARED)
    }


def assert_clean(engine: LLMEngine, rec: Recorder) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert not engine.has_unfinished()
    assert rec.stored == set(engine.cached_block_hashes())
    check_invariants(engine.kv)


def test_failed_prefill_caches_nothing_and_the_retry_is_exact(fresh) -> None:
    rec = Recorder()
    engine = make_engine(rec)
    fail_once(engine, lambda call: True)
    with pytest.raises(StepFailedError) as err:
        engine.generate([PROMPT, PROMPT], GREEDY)  # same step: the twin shares the blocks
    assert len(err.value.request_ids) == 2
    assert isinstance(err.value.__cause__, RuntimeError)
    assert engine.cached_block_hashes() == []  # the two hashed blocks were never written
    assert_clean(engine, rec)

    retry = engine.generate([PROMPT], GREEDY)
    assert retry[0].num_cached_tokens == 0
    assert tokens(retry) == [fresh[tuple(PROMPT)]]
    shared = engine.generate([SHARED], GREEDY)
    assert shared[0].num_cached_tokens == 32  # the retry's blocks, written this time
    assert tokens(shared) == [fresh[tuple(SHARED)]]
    assert_clean(engine, rec)


def test_failed_decode_withdraws_only_the_block_it_was_writing(fresh) -> None:
    rec = Recorder()
    engine = make_engine(rec)
    prompt = PROMPT[:31]  # the first decode step completes block 1 and hashes it
    first = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    engine.reset_prefix_cache()
    fail_once(engine, lambda call: call == 1)  # prefill succeeds, the first decode fails
    with pytest.raises(StepFailedError):
        engine.generate([prompt], GREEDY)
    ns = engine.namespace(None)
    written = hash_chain(prompt + tokens(first)[0], BLOCK, ns)
    assert len(written) == 2
    assert engine.cached_block_hashes() == written[:1]  # block 0 was written by the prefill
    assert_clean(engine, rec)

    retry = engine.generate([PROMPT], GREEDY)
    assert retry[0].num_cached_tokens == 16
    assert tokens(retry) == [fresh[tuple(PROMPT)]]
    assert tokens(engine.generate([SHARED], GREEDY)) == [fresh[tuple(SHARED)]]
    assert_clean(engine, rec)


def test_requests_outside_the_failed_step_go_on(fresh) -> None:
    rec = Recorder()
    engine = make_engine(rec, max_num_seqs=1)  # "b" waits while "a" runs
    fail_once(engine, lambda call: True)
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", SHARED, GREEDY)
    with pytest.raises(StepFailedError) as err:
        engine.step()
    assert err.value.request_ids == ("a",)
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "b"
            got += out.new_token_ids
    assert got == fresh[tuple(SHARED)]
    assert_clean(engine, rec)
    engine.add_request("a", PROMPT, GREEDY)  # the failed id is free again


def test_generate_withdraws_its_requests_that_did_not_run(fresh) -> None:
    rec = Recorder()
    engine = make_engine(rec, max_num_seqs=1)
    fail_once(engine, lambda call: True)
    with pytest.raises(StepFailedError):
        engine.generate([PROMPT, SHARED], GREEDY)  # SHARED was still waiting
    assert_clean(engine, rec)
    assert engine.step() == []  # and no stale "abort" output is left for the next caller
    assert tokens(engine.generate([PROMPT, SHARED], GREEDY)) == [
        fresh[tuple(PROMPT)],
        fresh[tuple(SHARED)],
    ]


def test_rollback_unhashes_blocks_freed_within_the_step() -> None:
    kv = KVCacheManager(8, BS)
    admit(kv, "old", list(range(8)))
    kv.commit_step()
    kv.free("old")
    kv.take_events()
    admit(kv, "a", [*range(8), 9, 9, 9, 9, 1])  # hits "old"'s 2 blocks, hashes a 3rd
    kv.free("a")  # e.g. a sample retired before the step raised
    kv.rollback_step()
    a = chain([*range(8), 9, 9, 9, 9])
    assert kv.take_events() == [BlockStored((a[2],)), BlockRemoved((a[2],))]
    assert kv.cached_hashes() == a[:2]  # committed earlier: still valid
    check_invariants(kv)  # the unhashed block moved to the front of the free queue
