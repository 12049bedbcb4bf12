"""Tier-2 smoke: simulated workers, the real router core and the real Redis index."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import Counter
from pathlib import Path

import pytest

from prefixserve.bench.micro.round_trip import RoundTrips
from prefixserve.bench.micro.router_copy import footprint
from prefixserve.bench.sim.router import IndexSpec, RouterProcess, SimRouter, check_policy
from prefixserve.bench.sim.simulate import (
    EVENT_LOG,
    LEASE_TTL_S,
    SimRequest,
    Simulator,
    fresh,
    main,
    parse_router_setting,
    parse_weight,
    simulate,
    trace_requests,
)
from prefixserve.router.blocks import Chain, hash_chain, namespace
from prefixserve.router.decision import Decision, LookupSource, RoutingCore
from prefixserve.router.decision_types import Candidate
from prefixserve.router.index import IndexSettings
from prefixserve.router.index_stores import open_index
from prefixserve.router.policy import PolicyConfig
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.sim.profiles import H100_LLAMA3_8B

pytestmark = pytest.mark.cluster
TRACE = Path(__file__).resolve().parents[1] / "bench/traces/mooncake_conversation_1000.jsonl"
PROFILE = H100_LLAMA3_8B


def conversation_rows(path: Path, n: int) -> Path:
    """The first ``n`` rows of the committed slice that belong to a conversation of two or
    more turns (their second hash id recurs): rows with reuse for a router to find."""
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    turns = Counter(r["hash_ids"][1] for r in rows if len(r["hash_ids"]) > 1)
    picked = [r for r in rows if len(r["hash_ids"]) > 1 and turns[r["hash_ids"][1]] > 1][:n]
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return path


def workload(tmp_path: Path, rows: int) -> tuple[list[SimRequest], EngineConfig]:
    """``rows`` conversation rows as requests (prompts cut to 4,096 tokens, 64 output tokens),
    and an engine config of 1,024 blocks with the H100 profile's batch limits."""
    trace = conversation_rows(tmp_path / "rows.jsonl", rows)
    requests = trace_requests(trace, PROFILE.vocab_size, max_input=4096, max_output=64)
    config = EngineConfig(num_blocks=1024, max_num_seqs=PROFILE.max_num_seqs,
                          max_num_batched_tokens=PROFILE.max_num_batched_tokens)
    return requests, config


def test_prefix_routing_beats_round_robin_under_the_ceiling(redis_server, tmp_path) -> None:
    profile = PROFILE
    requests, config = workload(tmp_path, 50)

    def run(policy: str):
        return asyncio.run(simulate(requests, profile, 8, policy, config, redis_server.url))

    prefix, rr = run("prefix"), run("round_robin")
    assert prefix.requests == rr.requests == 50 and not prefix.rejected
    assert prefix.lookups_failed == 0
    assert prefix.hit_rate > rr.hit_rate
    assert prefix.ceiling_hit_rate == rr.ceiling_hit_rate
    assert prefix.ceiling_hit_rate >= prefix.hit_rate
    assert prefix.ttft_p50_s > 0 and prefix.route_p99_ms > 0
    # a decision's parts lie within it, so no percentile of a part exceeds the decision's
    assert 0 < prefix.hash_p50_ms <= prefix.hash_p99_ms <= prefix.route_p99_ms
    assert 0 < prefix.rank_p50_ms <= prefix.rank_p99_ms <= prefix.route_p99_ms
    assert 0 < prefix.lookup_p50_ms <= prefix.lookup_p99_ms <= prefix.route_p99_ms
    assert math.isnan(rr.hash_p50_ms) and math.isnan(rr.rank_p99_ms)  # no ranking, no parts
    assert prefix.parts().startswith("prefix at 8 workers, decision parts, ms: hashing p50 ")
    # the work apart from the waits: one thread's CPU time never exceeds its wall time; Redis'
    # own time is the lookups' (none without an index); both add up per decision
    assert 0 < prefix.cpu_p50_ms <= prefix.cpu_p99_ms <= prefix.route_p99_ms
    assert 0 < prefix.redis_p50_ms <= prefix.redis_p99_ms <= prefix.route_p99_ms
    assert prefix.work_p50_ms >= max(prefix.cpu_p50_ms, prefix.redis_p50_ms)
    assert prefix.work_p99_ms >= max(prefix.cpu_p99_ms, prefix.redis_p99_ms)
    assert rr.cpu_p50_ms >= 0 and math.isnan(rr.redis_p50_ms) and math.isnan(rr.work_p99_ms)
    assert prefix.work().startswith("prefix at 8 workers, decision work, ms: router CPU p50 ")


def test_ray_prefix_follows_its_tree_and_weights_reach_the_ranking(redis_server, tmp_path) -> None:
    profile = PROFILE
    requests, config = workload(tmp_path, 40)
    ray = asyncio.run(simulate(requests, profile, 8, "ray_prefix", config, None))
    rr = asyncio.run(simulate(requests, profile, 8, "round_robin", config, None))
    assert ray.requests == 40 and not ray.rejected
    assert ray.hit_rate > rr.hit_rate  # later turns follow the tree to their holder
    # a weight given to the simulator reaches the ranking: when every cost ties, the deeper
    # match decides, and every request follows the shared first block to one worker
    default = asyncio.run(simulate(requests, profile, 8, "prefix", config, redis_server.url))
    affine = asyncio.run(simulate(requests, profile, 8, "prefix", config, redis_server.url,
                                  weights=PolicyConfig(tie_tolerance_s=1e9)))
    assert affine.busy_imbalance == 8.0 > default.busy_imbalance  # all on one of 8 workers
    assert affine.hit_rate == affine.ceiling_hit_rate > default.hit_rate
    weights = PolicyConfig(eviction_weight=0.7)
    sim = Simulator(profile, 2, "round_robin", config, None, weights=weights)
    assert isinstance(sim.router, SimRouter) and sim.router.state.settings.weights == weights


async def replay(requests: list[SimRequest], config: EngineConfig, redis_url: str,
                 own_process: bool = False, local_index: bool = False, **router: int,
                 ) -> tuple[Simulator, list[int | None]]:
    """A prefix-policy run over 8 workers: the simulator and where each request went."""
    model, settings = f"t-{time.time_ns()}", IndexSettings(lease_ttl_s=LEASE_TTL_S)
    index = open_index(redis_url, model, deadline_s=2.0, settings=settings)
    follow = EVENT_LOG if local_index else 0
    where = IndexSpec(redis_url, model, settings, 2.0, follow) if own_process else None
    sim = Simulator(PROFILE, 8, "prefix", config, index, router=router, router_process=where,
                    local_index=local_index)
    reqs = fresh(requests)
    asked, lookup = [], index.lookup

    async def counted(chain):
        asked.append(chain)
        return await lookup(chain)

    index.lookup = counted  # type: ignore[method-assign]
    try:
        await sim.run(reqs)
        index.lookup = lookup  # type: ignore[method-assign]
        if local_index and not own_process:
            # the local index answered every lookup (its follower reads loads as a lookup of
            # no block)
            assert asked and not [chain for chain in asked if chain]
        elif not own_process:  # (a router process has its own connection)
            assert len(asked) >= len(reqs)
        if local_index and not own_process:  # the copy holds what the index holds
            assert sim.local is not None
            await sim.local.catch_up()  # the events after the last decision
            for req in reqs[::5]:
                chain = hash_chain(req.tokens, config.block_size, ns(sim))
                want = {m.worker_id: m.confirmed_depth
                        for m in (await index.lookup(chain)).matches.values()}
                assert sim.local.held.depths(Chain.of(chain)) == want
    finally:
        await index.close()
    return sim, [r.worker for r in reqs]


def ns(sim: Simulator) -> bytes:
    return namespace(sim.workers[0].engine.model_fingerprint)


def test_long_prompts_hashed_as_needed_route_as_if_hashed_whole(redis_server) -> None:
    # 8 documents of 12,000 tokens, each asked about 5 times: past the first 4,096 tokens hashed
    docs = [[(d * 7919 + i) % PROFILE.vocab_size for i in range(12000)] for d in range(8)]
    requests = [SimRequest(k, [*docs[k % 8], *range(k, k + 100)], 16, 0.5 * k) for k in range(40)]
    config = EngineConfig(num_blocks=8192, max_num_seqs=PROFILE.max_num_seqs,
                          max_num_batched_tokens=PROFILE.max_num_batched_tokens)
    memo, with_memo = asyncio.run(replay(requests, config, redis_server.url))
    bare, without = asyncio.run(replay(requests, config, redis_server.url, hash_memo_tokens=0))
    assert isinstance(memo.router, SimRouter) and isinstance(bare.router, SimRouter)
    assert bare.router.state.memo.max_runs == 0 < memo.router.state.memo.max_runs
    # without the memo every deep match is found by hashing more and looking up again ...
    assert len(bare.router.timings.lookup_s) > len(memo.router.timings.lookup_s) >= len(requests)
    # ... and every request goes where the whole chains send it
    assert without == with_memo and len(set(with_memo)) > 1


def test_a_router_in_its_own_process_makes_the_same_decisions(redis_server, tmp_path) -> None:
    requests, config = workload(tmp_path, 40)
    here, routed_here = asyncio.run(replay(requests, config, redis_server.url))
    there, routed_there = asyncio.run(replay(requests, config, redis_server.url, True))
    assert isinstance(there.router, RouterProcess)
    assert routed_there == routed_here and len(set(routed_here)) > 1
    # its timings came back when it closed: one per decision, each lookup's, Redis' own
    timed = there.router.timings
    assert len(timed.route_s) == len(timed.cpu_s) == len(timed.redis_s) == len(requests)
    assert len(timed.lookup_s) == len(here.router.timings.lookup_s) >= len(requests)
    assert sum(timed.redis_s) > 0 and timed.lookups_failed == 0


def test_a_local_index_answers_as_the_redis_lookups_did(redis_server, tmp_path) -> None:
    requests, config = workload(tmp_path, 40)
    _, routed_redis = asyncio.run(replay(requests, config, redis_server.url))
    local, routed_local = asyncio.run(replay(requests, config, redis_server.url,
                                             local_index=True))
    assert isinstance(local.router, SimRouter) and local.router.local is local.local
    assert routed_local == routed_redis and len(set(routed_local)) > 1
    assert len(local.router.timings.lookup_s) >= len(requests)
    asyncio.run(local.router.close())
    assert local.router.timings.copy_bytes == footprint(local.local.held) > 0
    # a router process follows the log itself, decides the same, and says what it holds
    there, routed_there = asyncio.run(replay(requests, config, redis_server.url, True,
                                             local_index=True))
    assert isinstance(there.router, RouterProcess) and there.local is None
    assert routed_there == routed_redis
    timed = there.router.timings
    assert len(timed.lookup_s) >= len(requests) and not timed.redis_s
    assert timed.copy_bytes > 0 and timed.max_rss_bytes > 2**20


def test_policies_are_checked_before_anything_starts() -> None:
    check_policy("round_robin", None)
    check_policy("prefix", object())
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        check_policy("random", object())
    with pytest.raises(ValueError, match="the prefix policy needs an index"):
        check_policy("prefix", None)


def test_weight_option_parses_and_refuses_unknown_names() -> None:
    assert parse_weight("eviction_weight=0.5") == ("eviction_weight", 0.5)
    with pytest.raises(argparse.ArgumentTypeError, match="eviction_weight"):
        parse_weight("block_size=8")  # internal: set from the engine, not a weight
    with pytest.raises(argparse.ArgumentTypeError):
        parse_weight("uncached_weight")
    assert parse_router_setting("max_match_tokens=64") == ("max_match_tokens", 64)
    with pytest.raises(argparse.ArgumentTypeError, match="hash_memo_tokens"):
        parse_router_setting("lookup_deadline_s=1")


@pytest.mark.parametrize(("policy", "measured"), [("prefix", True), ("round_robin", False)])
def test_cli_writes_the_runs_and_the_round_trips_beside_them(
    redis_server, tmp_path, capsys, policy: str, measured: bool
) -> None:
    trace = conversation_rows(tmp_path / "rows.jsonl", 12)
    out = tmp_path / "sim.json"
    main(["--workers", "2", "--policy", policy, "--trace", str(trace), "--max-input", "1024",
          "--max-output", "8", "--num-blocks", "256", "--redis-url", redis_server.url,
          "--out", str(out)])
    report = json.loads(out.read_text())
    assert [(r["policy"], r["workers"], r["requests"]) for r in report["runs"]] == [
        (policy, 2, 12)]
    printed = capsys.readouterr().out
    trips = report["round_trips"]
    if not measured:  # no index, no round trip to read the decisions against
        assert trips is None and "PING" not in printed
        return
    assert trips["work_ms"] == 3.0
    assert 0 < trips["back_to_back_p50_ms"] <= trips["back_to_back_p99_ms"]
    assert 0 < trips["after_work_p50_ms"] <= trips["after_work_p99_ms"]
    assert printed.splitlines()[-1] == RoundTrips(**trips).line()


async def test_the_simulator_decides_as_a_serve_router_core_does(redis_server) -> None:
    """The same requests, candidates and clock through the simulator's router and through a
    core built as the Serve request router builds its own (state, lookup source): the same
    decisions, one by one, from the same code."""
    model, settings = f"core-{time.time_ns()}", IndexSettings(lease_ttl_s=60.0)
    index = open_index(redis_server.url, model, deadline_s=2.0, settings=settings)
    names = [f"w{i}" for i in range(4)]
    for name in names:
        await index.register(name, epoch=1, block_size=16, fingerprint="fp")
    router_settings = RouterSettings(model=model, block_size=16, fingerprint="fp")
    sim = SimRouter("prefix", names, index, router_settings, index_deadline_s=2.0)
    await sim.start()
    state = RouterState(router_settings, settings)
    serve_core = RoutingCore(state, LookupSource(state, index, None, 2.0))
    state.gate.check_workers(await index.live_workers(), [], 0.0)
    seen: list[Decision] = []
    decide = sim.core.decide

    async def recorded(*args, **kwargs) -> Decision:
        seen.append(await decide(*args, **kwargs))
        return seen[-1]

    sim.core.decide = recorded  # type: ignore[method-assign]
    ongoing = [0, 0, 0, 0]
    for key in range(12):
        tokens = [key % 3] * 48 + list(range(key, key + 40))  # three shared prefixes
        now = 10.0 + key
        chosen = await sim.route(key, tokens, ongoing, now)
        candidates = [Candidate(n, queue_len=q) for n, q in zip(names, ongoing, strict=True)]
        mine = await serve_core.decide(key, tokens, None, candidates, str(key), now)
        serve_core.sent(key, mine.best, str(key), now)
        theirs = seen[-1]
        assert names[chosen] == theirs.best == mine.best
        assert theirs.ranking.keys == mine.ranking.keys
        assert [x.matched_blocks for x in theirs.ranking] == [
            x.matched_blocks for x in mine.ranking]
        assert [a.source for a in theirs.lookups] == [a.source for a in mine.lookups] != []
        ongoing[chosen] += 1
    assert len(seen) == 12 and len(set(ongoing)) > 1  # decided, and not all on one worker
    await index.close()
