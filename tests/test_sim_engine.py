"""The simulated engine keeps the real engine's books: same KV events, same cache, same hits.

The real engine runs the tiny built-in model; the simulated one replays the real one's tokens
(its token source), so any difference is in the scheduling and KV bookkeeping, which must be
none. The script mixes chunked prefills, shared prefixes, evictions, preemption, an abort, a
forked n=2 request and a cache reset in a pool small enough to run dry.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import BUSY_WINDOW_S, BusyShare, EngineConfig
from prefixserve.workers.kv_tensor import kv_bytes_per_token
from prefixserve.workers.models.config import load_model_config
from prefixserve.workers.scheduler import Sequence
from prefixserve.workers.sim.engine import SimEngine
from prefixserve.workers.sim.profiles import CPU_SMOLLM2, H100_LLAMA3_8B, SimProfile, profile_for

CONFIG = EngineConfig(block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=24,
                      device="cpu", model_fingerprint="equivalence")


def _params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


SHARED = list(range(3, 23))  # 5 blocks every "s" prompt starts with
SCRIPT: dict[int, list[tuple]] = {  # step -> actions before it
    0: [("add", "a", [*SHARED, 40, 41, 42], _params(6)),
        ("add", "b", [*SHARED, 50, 51], _params(5))],
    2: [("add", "c", list(range(60, 90)), _params(4)),
        ("add", "d", [*SHARED, 70], _params(3, n=2))],
    4: [("abort", "c")],
    5: [("add", "e", [*SHARED, 40, 41, 42, 43, 44], _params(9))],
    9: [("add", "f", list(range(100, 140)), _params(2))],
    16: [("add", "h", list(range(200, 250)), _params(2))],  # evicts f's blocks
    24: [("add", "i", list(range(100, 140)), _params(2))],  # f's prompt: from the host tier
    30: [("reset",)],
    31: [("add", "g", [*SHARED, 40], _params(2))],
}


def _run(engine, batches: list) -> tuple[list, list, list]:
    """Apply the script; per step: the events, the outputs, the cached set."""
    steps, cached, outputs = [], [], []
    for i in range(60):
        for action in SCRIPT.get(i, ()):
            if action[0] == "add":
                engine.add_request(action[1], action[2], action[3])
            elif action[0] == "abort":
                engine.abort(action[1])
            else:
                engine.reset_prefix_cache()
        batches.clear()
        outs = engine.step()
        steps.append(list(batches))
        outputs.append([(o.request_id, o.index, o.new_token_ids, o.finish_reason,
                         o.num_cached_tokens) for o in outs])
        cached.append(sorted(engine.cached_block_hashes()))
    return steps, outputs, cached


def with_host_tier(config: EngineConfig, slots: int, block_bytes: int) -> EngineConfig:
    """`config` with a host KV tier of `slots` blocks of `block_bytes`."""
    if not slots:
        return config
    size = (slots + 0.5) * block_bytes / 2**30
    return config.model_copy(update={"kv_offloading_size": size})


@pytest.fixture(scope="module", params=[0, 16], ids=["no-tiers", "host-tier"])
def real_run(request, tmp_path_factory) -> tuple[list, list, list, object, int]:
    path = ensure_builtin_model(tmp_path_factory.mktemp("cache"))
    batches: list = []
    per_block = kv_bytes_per_token(load_model_config(path), "float32") * CONFIG.block_size
    config = with_host_tier(CONFIG, request.param, per_block)
    engine = LLMEngine.from_pretrained(path, config, on_kv_events=batches.append)
    assert engine.tiers is None or engine.tiers.host.num_slots == request.param
    return (*_run(engine, batches), engine.stats(), request.param)


def test_events_cache_and_outputs_equal_the_real_engine(real_run) -> None:
    """With a host tier too: the simulator's tiers are the real engine's, without contents."""
    events, outputs, cached, stats, slots = real_run
    tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
    for step in outputs:
        for rid, index, new, _, _ in step:
            tokens[rid, index].extend(new)

    def replay(seq: Sequence) -> int:
        return tokens[seq.request_id, seq.index][seq.num_output_tokens]

    batches: list = []
    config = with_host_tier(CONFIG, slots, CPU_SMOLLM2.kv_bytes_per_token * CONFIG.block_size)
    sim = SimEngine(CPU_SMOLLM2, config, batches.append, token_source=replay)
    sim_events, sim_outputs, sim_cached = _run(sim, batches)
    assert sum(map(len, events)) > 10  # the script did exercise the cache
    assert stats.num_preemptions > 0 and any(c for c in cached)
    assert sim_events == events
    assert sim_cached == cached
    assert sim_outputs == outputs
    sim_stats = sim.stats()
    assert (sim_stats.prompt_tokens_hit, sim_stats.prompt_tokens_queried,
            sim_stats.num_preemptions) == (stats.prompt_tokens_hit, stats.prompt_tokens_queried,
                                           stats.num_preemptions)
    assert (sim_stats.external_tokens_hit, sim_stats.external_tokens_queried) == (
        stats.external_tokens_hit, stats.external_tokens_queried)
    if slots:  # the script evicted into the tier and hit it
        assert stats.external_tokens_hit > 0 and stats.tiers.offloaded_bytes["host"] > 0
    assert sim.clock_s > 0 and not sim.has_unfinished()


def test_step_time_grows_with_uncached_tokens_batch_and_context() -> None:
    p = H100_LLAMA3_8B
    assert p.step_seconds([], []) == 0.0
    assert p.step_seconds([(1000, 0)], []) > p.step_seconds([(100, 900)], [])
    assert p.step_seconds([], [1000] * 8) > p.step_seconds([], [1000] * 2)
    assert p.step_seconds([], [8000]) > p.step_seconds([], [100])
    # a cached prefix saves prefill time: the same prompt tail after 900 cached tokens
    assert p.step_seconds([(100, 900)], []) < p.step_seconds([(1000, 0)], []) / 3


def test_virtual_clock_and_profiles() -> None:
    eng = SimEngine(H100_LLAMA3_8B, EngineConfig(num_blocks=64))
    assert eng.describe_compute() == "simulated"
    eng.add_request("r", list(range(100)), _params(3))
    while eng.has_unfinished():
        eng.step()
    # one prefill step and two decode steps, each at least a weights read
    assert eng.clock_s >= 3 * H100_LLAMA3_8B.decode_base_s
    assert profile_for("sim:h100-llama3-8b") is H100_LLAMA3_8B
    assert isinstance(profile_for("cpu-smollm2"), SimProfile)
    with pytest.raises(ValueError, match="known: sim:cpu-smollm2"):
        profile_for("sim:nope")
    assert CPU_SMOLLM2.fingerprint != H100_LLAMA3_8B.fingerprint


def test_busy_share_decays_over_its_window_and_reaches_the_load_report() -> None:
    share = BusyShare(window_s=100.0)
    assert share.read(5.0) == 0.0
    share.add(10.0, now=0.0)
    share.add(20.0, now=50.0)
    assert share.read(50.0) == pytest.approx(0.1 * math.exp(-0.5) + 0.2)
    assert share.read(150.0) == pytest.approx((0.1 * math.exp(-0.5) + 0.2) * math.exp(-1))
    assert share.read(20.0) == pytest.approx(0.1 * math.exp(-0.5) + 0.2)  # no growth backwards
    share.add(500.0, now=150.0)
    assert share.read(150.0) == 1.0
    now = [1000.0]
    eng = SimEngine(H100_LLAMA3_8B, EngineConfig(num_blocks=64))
    eng.clock = lambda: now[0]
    eng.add_request("r", list(range(100)), _params(1))
    eng.step()
    assert eng.last_step_s > 0
    now[0] += BUSY_WINDOW_S
    stats = eng.stats()
    assert stats.busy_share == pytest.approx(eng.last_step_s / BUSY_WINDOW_S * math.exp(-1))
    assert stats.load(1.0).busy_share == stats.busy_share


def test_a_replica_loads_a_sim_model_that_sleeps_its_steps() -> None:
    from prefixserve.workers.model_sources import model_source

    events: list = []
    model = "sim:cpu-smollm2"
    eng = model_source(model).load_engine(model, EngineConfig(num_blocks=64), events.append)
    assert isinstance(eng, SimEngine) and eng.sleep
    # its token ids are the sim tokenizer's (docs/simulation.md), its cache namespace the profile's
    assert eng.model_fingerprint == CPU_SMOLLM2.fingerprint and eng.vocab_size == 264
