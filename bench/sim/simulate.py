"""Scale by simulation: replay a trace against 64 to 1,000 simulated workers in one process.

No Ray and no model. Each worker is a :class:`workers.sim.engine.SimEngine` (the real scheduler
and KV bookkeeping, a profile's step times); the router is the real pure core
(:class:`router.router_state.RouterState` ranking with :mod:`router.policy`) against the real
Redis prefix index (a private ``redis-server``), fed by the calls a worker's
:class:`router.publisher.EventPublisher` makes: register, resync, one ``apply`` per batch of
KV events (``publish_lag_s`` after the step that made them) and a load heartbeat every
``heartbeat_s``. Time is simulated: an event loop over timestamps (arrivals, step completions,
event flushes, heartbeats) runs as fast as the CPU allows, so an hour of trace takes minutes.

Policies: ``prefix`` (the real ranking), ``pow2`` (two random workers, the one with fewer
ongoing requests, as Serve's router), ``round_robin`` and ``ray_prefix`` (Ray Serve's
``PrefixCacheAffinityRouter`` decision on Ray's own ``PrefixTree``, with its defaults: the
replicas holding the longest token prefix when it covers at least 10% of the prompt, else the
replicas with the fewest tree characters, then the fewest ongoing requests). Per run it reports
the prefix-cache hit rate against the merged-cache ceiling (one LRU pool the size of the whole
cluster taking the prompts in arrival order: no router can do better without more memory),
TTFT percentiles, worker busy-time imbalance (max / mean) and the router's decision time (wall
clock, hashing + index lookup + ranking, as the ``prefixserve_router_latency_seconds`` metric
measures). With the prefix policy it also prints each decision's parts, its work apart from the
machine's waits (the router's CPU time plus Redis' own time running its lookups, from the
SLOWLOG: :mod:`bench.micro.redis_time`) and what a Redis PING costs on this machine back to back and
after 3 ms of work (:mod:`bench.micro.round_trip`): the floor under every decision's lookup.

Departures from the live system, by design: leases and predicted entries expire in Redis' wall
time, so leases are set long (``LEASE_TTL_S``) and routing-time predictions stay in the
router's own :class:`router.router_state.LocalPredictions` (simulated time), which is what a
single router consults first anyway; Serve's queue length is the router's own count of ongoing
requests.

    python -m prefixserve.bench.sim.simulate --workers 16,64 \\
        --policy prefix,pow2,round_robin,ray_prefix \\
        --trace bench/traces/mooncake_conversation_1000.jsonl --out sim.json

or generates its workload (``--workload chat|groups``, :mod:`prefixserve.bench.sim.workloads`):
chat users whose later turns arrive a think time after their last reply, and Zipf-popular
shared-prompt groups, at a rate that sets the fleet's load.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import itertools
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import uvloop

from prefixserve.bench.load.workloads import Tokens, Trace
from prefixserve.bench.micro.redis_time import lookup_clock
from prefixserve.bench.micro.round_trip import RoundTrips
from prefixserve.bench.micro.round_trip import measure as measure_round_trips
from prefixserve.bench.percentile import percentile
from prefixserve.bench.sim.router import (
    POLICIES,
    IndexSpec,
    RouterProcess,
    RouterSpec,
    SimRouter,
    check_policy,
)
from prefixserve.bench.sim.workloads import WORKLOADS, SimSession, workload
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace, token_array
from prefixserve.router.events import EventBatch, KVEvent
from prefixserve.router.index import IndexSettings, IndexUnavailable, PrefixIndex, ResultCode
from prefixserve.router.index_follower import IndexFollower, event_logs
from prefixserve.router.index_stores import open_index
from prefixserve.router.policy import PolicyConfig
from prefixserve.router.publisher import batch_length
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine_types import EngineConfig, RequestOutput
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.kv_cache import KVCacheManager
from prefixserve.workers.sim.engine import SimEngine, hashed_reply
from prefixserve.workers.sim.profiles import SimProfile, profile_for

LEASE_TTL_S = 3600.0  # wall-clock lease: far longer than any simulated run takes
EVENT_LOG = 100_000  # the index's event log with --local-index: its follower never falls behind
IDLE_HEARTBEAT_S = 5.0  # an idle worker's report interval (the replica's is lease / 3)
GC_EVERY_EVENTS = 2000  # young generations collected this often (every 100th: all of them)
INDEX_DEADLINE_S = 2.0  # generous: a busy simulator must not fail open where a router would not
WEIGHT_NAMES = {f.name for f in fields(PolicyConfig) if not f.metadata.get("internal")}
# Arrivals come this long after the loads reported at registration (time 0), so the router counts
# what it sends at the trace's time 0 as not yet in them: a live router's clock never stands
# still between a report and a route, simulated time would.
ARRIVAL_LAG_S = 1e-6


@dataclass
class SimRequest:
    """One trace row on its way through the simulated cluster."""

    key: int
    tokens: Sequence[int]  # a token_array from trace_requests, as the ingress sends a prompt
    output_len: int
    arrival_s: float  # a later chat turn's: set when the turn it follows has finished
    after: int | None = None  # the key of the turn this one follows (a chat user's)
    think_s: float = 0.0  # from that turn's finish to this one's arrival
    reply: Sequence[int] = ()  # its reply, where the next turn's prompt resends it (chat)
    worker: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: bool = False


@dataclass
class SimWorker:
    """A simulated replica: its engine, its index identity and its step bookkeeping."""

    index: int
    name: str
    engine: SimEngine
    worker_id: int = 0
    stepping: bool = False
    busy_s: float = 0.0
    ongoing: int = 0  # the router's count (Serve's queue length)
    step_events: list[KVEvent] = field(default_factory=list)  # made by the running step
    unpublished: list[KVEvent] = field(default_factory=list)  # waiting for the flush
    flush_due: bool = False
    seq: int = 0
    idle_reported_at: float | None = None  # when it last reported itself idle
    dirty: bool = False  # an apply failed: the next flush replaces the whole set (resync)


@dataclass
class RunResult:
    """One (policy, workers) run: the figures the table prints."""

    policy: str
    workers: int
    requests: int
    rejected: int
    hit_rate: float  # cached tokens from every KV tier, of the prompt tokens
    ceiling_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_ms: float  # time per output token after the first
    tpot_p90_ms: float
    busy_imbalance: float
    route_p99_ms: float
    route_p50_ms: float
    lookup_p99_ms: float  # the index lookup's share of a decision (prefix only)
    sim_time_s: float
    wall_s: float
    lookups_failed: int = 0
    index_failures: int = 0
    # a prefix decision's parts (the chain it starts with, each lookup, ranking), so a decision
    # time can be read without a profiler
    hash_p50_ms: float = 0.0
    hash_p99_ms: float = 0.0
    lookup_p50_ms: float = 0.0
    rank_p50_ms: float = 0.0
    rank_p99_ms: float = 0.0
    # a decision's work apart from the machine's waits: the router's CPU time, Redis' own time
    # running its lookups (SLOWLOG; prefix only) and their sum per decision
    cpu_p50_ms: float = 0.0
    cpu_p99_ms: float = 0.0
    redis_p50_ms: float = 0.0
    redis_p99_ms: float = 0.0
    work_p50_ms: float = 0.0
    work_p99_ms: float = 0.0
    # with --local-index: the follower copy's bytes at the end; with --router-process too, the
    # router process's peak resident memory
    copy_mib: float = 0.0
    router_rss_mib: float = 0.0
    unlimited_hit_rate: float = 0.0  # the workload's hit rate with unlimited cache
    host_hit_share: float = 0.0  # of the cached tokens, those loaded from the host tier
    load: float = 0.0  # the workers' mean busy time over the run's simulated time
    moved: float = 0.0  # of the later chat turns, those sent to another worker than the last

    def parts(self) -> str:
        return (f"{self.policy} at {self.workers} workers, decision parts, ms: hashing p50 "
                f"{self.hash_p50_ms:.3f} p99 {self.hash_p99_ms:.3f}; each lookup p50 "
                f"{self.lookup_p50_ms:.3f} p99 {self.lookup_p99_ms:.3f}; ranking p50 "
                f"{self.rank_p50_ms:.3f} p99 {self.rank_p99_ms:.3f}")

    def memory(self) -> str:
        rss = f"; router process peak RSS {self.router_rss_mib:.0f} MiB" \
            if self.router_rss_mib else ""
        return (f"{self.policy} at {self.workers} workers, the router's copy of the index "
                f"{self.copy_mib:.1f} MiB{rss}")

    def work(self) -> str:
        return (f"{self.policy} at {self.workers} workers, decision work, ms: router CPU p50 "
                f"{self.cpu_p50_ms:.3f} p99 {self.cpu_p99_ms:.3f}; Redis' own time p50 "
                f"{self.redis_p50_ms:.3f} p99 {self.redis_p99_ms:.3f}; both p50 "
                f"{self.work_p50_ms:.3f} p99 {self.work_p99_ms:.3f} (wall p50 "
                f"{self.route_p50_ms:.3f} p99 {self.route_p99_ms:.3f})")


def merged_ceiling(chains: Sequence[Sequence[bytes]], lengths: Sequence[int], num_blocks: int,
                   block_size: int, held: Sequence[int] | None = None) -> float:
    """Hit rate of one LRU pool of ``num_blocks`` taking the prompts in order, each computed
    and freed before the next (the real pool's bookkeeping: same reuse, same eviction order).
    ``held``: the tokens each request leaves cached where that is more than its prompt (its
    reply, which a later prompt resends; ``chains`` then cover them).

    A pool at least as large as every block the prompts take never evicts, so it is cut to that
    size: the same answer without millions of idle blocks at 1,000 workers."""
    held = held or lengths
    needed = sum(-(-n // block_size) for n in held)
    kv = KVCacheManager(max(1, min(num_blocks, needed)), block_size)
    hit = total = 0
    for i, (chain, n, keep) in enumerate(zip(chains, lengths, held, strict=True)):
        hits = kv.computed_blocks(chain, n)
        cached = len(hits) * block_size
        if kv.allocate_slots(str(i), cached, keep - cached, chain, hits):
            kv.commit_step()
            kv.free(str(i))
        kv.take_events()
        hit += cached
        total += n
    return hit / total if total else 0.0


class Simulator:
    """One run: ``num_workers`` simulated workers behind one router, in simulated time."""

    def __init__(
        self,
        profile: SimProfile,
        num_workers: int,
        policy: str,
        engine_config: EngineConfig,
        index: PrefixIndex | None,
        *,
        publish_lag_s: float = 0.005,
        heartbeat_s: float = 1.0,
        seed: int = 0,
        weights: PolicyConfig | None = None,
        router: Mapping[str, Any] | None = None,
        redis_time: Callable[[], float] | None = None,
        router_process: IndexSpec | None = None,
        local_index: bool = False,
    ) -> None:
        """``router``: RouterSettings fields; ``redis_time``: Redis' own ms running the
        lookups since its last call (read after each prefix decision, outside its timing);
        ``router_process``: run the router in a process of its own, with its own connection
        to this index (and its own Redis timing; its ``follow_log`` for a follower of its
        own); ``local_index``: answer the router's lookups in process, from a follower of the
        index's event log, caught up before each decision."""
        check_policy(policy, index)  # here too: a router process would only fail at start
        self.profile = profile
        self.policy = policy
        self.index = index if policy == "prefix" else None
        self.publish_lag_s = publish_lag_s
        self.heartbeat_s = heartbeat_s
        self.workers = [self._worker(i, engine_config) for i in range(num_workers)]
        settings = RouterSettings(
            model="sim", block_size=engine_config.block_size,
            fingerprint=self.workers[0].engine.model_fingerprint,
            weights=weights or PolicyConfig(), **(router or {}))
        names = tuple(w.name for w in self.workers)
        self.router: SimRouter | RouterProcess
        self.local = None
        if local_index and self.index is not None and router_process is None:
            logs = event_logs(self.index)
            if logs is None:
                raise ValueError("a local index follows the index's event log: this one has none")
            self.local = IndexFollower(self.index, logs, log_entries=EVENT_LOG)
        if router_process is None:
            self.router = SimRouter(policy, names, self.index, settings,
                                    index_deadline_s=INDEX_DEADLINE_S, seed=seed,
                                    redis_time=redis_time, local=self.local)
        else:
            self.router = RouterProcess(RouterSpec(policy, names, settings, seed,
                                                   router_process))
        self._heap: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self.index_failures = 0  # worker-side calls that timed out (resynced after)
        self._now = 0.0
        self._live: dict[str, SimRequest] = {}
        self._next_turns: dict[int, SimRequest] = {}  # by the key of the turn each follows

    def _worker(self, i: int, config: EngineConfig) -> SimWorker:
        worker = SimWorker(i, f"sim-worker-{i}", SimEngine(self.profile, config))
        worker.engine.clock = lambda: self._now  # its busy share runs on simulated time
        worker.engine.on_kv_events = worker.step_events.extend
        return worker

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, payload))

    # ------------------------------------------------------------------ index side (workers)

    async def _register(self) -> None:
        assert self.index is not None
        for w in self.workers:
            w.worker_id = await self.index.register(
                w.name, epoch=1, block_size=w.engine.block_size,
                fingerprint=w.engine.model_fingerprint, node="sim")
            await self.index.resync(w.worker_id, 1, [], 0)
            await self._heartbeat(w, 0.0)

    async def _heartbeat(self, w: SimWorker, now: float) -> None:
        assert self.index is not None
        s = w.engine.stats()
        idle = not (s.num_running or s.num_waiting)
        since = w.idle_reported_at
        if idle and since is not None and now - since < IDLE_HEARTBEAT_S:
            return  # an idle load changes only in its busy share, which decays slowly
        w.idle_reported_at = now if idle else None
        try:
            await self.index.heartbeat(w.worker_id, 1, s.load(now))
        except IndexUnavailable:
            self.index_failures += 1
            w.idle_reported_at = None

    async def _flush(self, w: SimWorker) -> None:
        """Apply the unpublished events in batches; after a failure, as the publisher does,
        replace the worker's whole set instead (the engine is the source of truth)."""
        w.flush_due = False
        events, w.unpublished = w.unpublished, []
        if self.index is None or not (events or w.dirty):
            return
        try:
            if w.dirty:
                await self.index.resync(w.worker_id, 1, w.engine.cached_block_hashes(), w.seq)
                w.dirty = False
                return
            for batch in _batches(events):
                w.seq += 1
                result = await self.index.apply(EventBatch(w.worker_id, 1, w.seq, batch))
                if result is not ResultCode.OK:
                    raise IndexUnavailable(f"apply answered {result.name}")
        except IndexUnavailable:
            self.index_failures += 1
            w.dirty = w.flush_due = True
            self._push(self._now + self.publish_lag_s, "flush", w)

    # ------------------------------------------------------------------ the event loop

    async def run(self, requests: Sequence[SimRequest]) -> float:
        """Replay ``requests``; returns the simulated time when the last one finished."""
        if self.index is not None:
            await self._register()
            self._push(self.heartbeat_s, "heartbeat", None)
        await self.router.start()
        for req in requests:
            if req.after is None:
                req.arrival_s += ARRIVAL_LAG_S
                self._push(req.arrival_s, "arrival", req)
            else:
                self._next_turns[req.after] = req
        pending = len(requests)
        # The simulated fleet allocates far more than a router does, and the collector's pauses
        # it triggers would land inside the routing decisions timed here: collect between
        # events instead (the fleet's setup frozen, out of every pass).
        was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            await self._replay(pending)
        finally:
            gc.unfreeze()
            if was_enabled:
                gc.enable()
            await self.router.close()
        return self._now

    async def _replay(self, pending: int) -> None:
        events = 0
        while self._heap and (pending or any(w.stepping for w in self.workers)):
            events += 1
            if events % GC_EVERY_EVENTS == 0:
                gc.collect(1 if events % (100 * GC_EVERY_EVENTS) else 2)
            now, _, kind, payload = heapq.heappop(self._heap)
            self._now = now
            if kind == "arrival":
                assert isinstance(payload, SimRequest)
                pending -= 1
                await self._arrive(payload, now)
            elif kind == "step":
                assert isinstance(payload, tuple)
                await self._step_done(payload[0], payload[1], now)
            elif kind == "flush":
                assert isinstance(payload, SimWorker)
                await self._flush(payload)
            else:
                for w in self.workers:
                    await self._heartbeat(w, now)
                self._push(now + self.heartbeat_s, "heartbeat", None)

    async def _arrive(self, req: SimRequest, now: float) -> None:
        ongoing = [w.ongoing for w in self.workers]  # Serve's queue lengths
        if self.local is not None:  # what a follower has read by now, in simulated time
            await self.local.catch_up()
        worker = self.workers[await self.router.route(req.key, req.tokens, ongoing, now)]
        req.worker = worker.index
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        try:
            worker.engine.add_request(str(req.key), req.tokens, params)
        except InvalidRequestError:
            req.rejected = True
            self.router.completed(worker.index, req.key)
            self._next_turn(req, now)
            return
        worker.ongoing += 1
        self._live[str(req.key)] = req
        if not worker.stepping:
            self._start_step(worker, now)

    def _next_turn(self, req: SimRequest, now: float) -> None:
        """A chat user's next turn arrives a think time after the reply to this one."""
        turn = self._next_turns.pop(req.key, None)
        if turn is not None:
            turn.arrival_s = now + turn.think_s
            self._push(turn.arrival_s, "arrival", turn)

    def _start_step(self, w: SimWorker, now: float) -> None:
        outputs = w.engine.step()
        seconds = w.engine.last_step_s
        if seconds == 0.0 and not outputs:
            w.stepping = False
            return
        w.stepping = True
        w.busy_s += seconds
        self._push(now + seconds, "step", (w, outputs))

    async def _step_done(self, w: SimWorker, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            if req.first_token_s is None and out.new_token_ids:
                req.first_token_s = now
            if out.finished:
                req.finish_s = now
                del self._live[out.request_id]
                w.ongoing -= 1
                self.router.completed(w.index, req.key)
                self._next_turn(req, now)
        if w.step_events:
            w.unpublished.extend(w.step_events)
            w.step_events.clear()
            if not w.flush_due and self.index is not None:
                w.flush_due = True
                self._push(now + self.publish_lag_s, "flush", w)
        w.stepping = False
        if w.engine.has_unfinished():
            self._start_step(w, now)


def _batches(events: Sequence[KVEvent]) -> list[tuple[KVEvent, ...]]:
    """Events cut into batches as the publisher cuts them (an event is never cut)."""
    out: list[tuple[KVEvent, ...]] = []
    start = 0
    while start < len(events):
        take = batch_length(events, start)
        out.append(tuple(events[start : start + take]))
        start += take
    return out


# ---------------------------------------------------------------------- trace and runs


def trace_requests(path: str | Path, vocab_size: int, *, limit: int | None = None,
                   speedup: float = 1.0, max_input: int | None = None,
                   max_output: int | None = None) -> list[SimRequest]:
    """A Mooncake trace as token-id requests (bench.load.workloads.Trace: 512-token runs per id)."""
    trace = Trace(path=path, limit=limit, speedup=speedup, max_input=max_input,
                  max_output=max_output)
    sessions = trace.sessions(Tokens(vocab_size))
    return [SimRequest(i, token_array(s.turns[0].tokens or []), s.turns[0].output_len,
                       s.arrival_s or 0.0)
            for i, s in enumerate(sessions)]


def session_requests(sessions: Sequence[SimSession], vocab_size: int) -> list[SimRequest]:
    """Generated sessions (bench.sim.workloads) as requests, each later turn after its last and
    resending it with the reply the simulated engine gives it (``hashed_reply``)."""
    out: list[SimRequest] = []
    for s in sessions:
        history: list[int] = []
        for t, turn in enumerate(s.turns):
            if t:
                last = out[-1]
                last.reply = hashed_reply(vocab_size, str(last.key), last.output_len)
                history += last.reply
            history += turn.tokens
            out.append(SimRequest(len(out), token_array(history), turn.output_len,
                                  s.arrival_s if t == 0 else 0.0,
                                  after=None if t == 0 else len(out) - 1,
                                  think_s=s.think_s[t - 1] if t else 0.0))
    return out


def fresh(requests: Sequence[SimRequest]) -> list[SimRequest]:
    return [SimRequest(r.key, r.tokens, r.output_len, r.arrival_s, r.after, r.think_s, r.reply)
            for r in requests]


async def simulate(
    requests: Sequence[SimRequest],
    profile: SimProfile,
    num_workers: int,
    policy: str,
    config: EngineConfig,
    redis_url: str | None,
    *,
    ceiling: float | None = None,
    router_process: bool = False,
    **options: Any,
) -> RunResult:
    """One run on fresh copies of ``requests``; ``ceiling`` is computed when not given;
    ``options`` are :class:`Simulator`'s keywords (publish lag, heartbeat, seed, weights,
    router: RouterSettings fields)."""
    reqs = fresh(requests)
    index = None
    model = f"sim-{policy}-{num_workers}-{time.time_ns()}"
    settings = IndexSettings(lease_ttl_s=LEASE_TTL_S)
    if policy == "prefix":
        assert redis_url is not None, "the prefix policy needs redis_url"
        index = open_index(redis_url, model, deadline_s=INDEX_DEADLINE_S, settings=settings)
    url = redis_url if index is not None else None
    follow = EVENT_LOG if options.get("local_index") else 0
    where = IndexSpec(url, model, settings, INDEX_DEADLINE_S, follow) if router_process else None
    with lookup_clock(None if router_process else url) as redis_time:
        sim = Simulator(profile, num_workers, policy, config, index, redis_time=redis_time,
                        router_process=where, **options)
        start = time.perf_counter()
        try:
            end = await sim.run(reqs)
        finally:
            if index is not None:
                await index.close()
        wall = time.perf_counter() - start
    served = [r for r in reqs if not r.rejected]
    if ceiling is None:
        ceiling = ceiling_for(served, sim.workers[0].engine, num_workers)
    unlimited = ceiling_for(served, sim.workers[0].engine, None)
    ttft = [r.first_token_s - r.arrival_s for r in served if r.first_token_s is not None]
    stats = [w.engine.stats() for w in sim.workers]
    queried = sum(s.prompt_tokens_queried for s in stats)
    hit = sum(s.prompt_tokens_hit + s.external_tokens_hit for s in stats)
    external = sum(s.external_tokens_hit for s in stats)
    busy = [w.busy_s for w in sim.workers]
    mean_busy = sum(busy) / len(busy)
    timed = sim.router.timings
    route_ms = [s * 1000 for s in timed.route_s]
    return RunResult(
        policy=policy, workers=num_workers, requests=len(reqs),
        rejected=len(reqs) - len(served),
        hit_rate=hit / queried if queried else 0.0,
        ceiling_hit_rate=ceiling, unlimited_hit_rate=unlimited,
        host_hit_share=external / hit if hit else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot := [(r.finish_s - r.first_token_s) * 1000 / (r.output_len - 1)
                                        for r in served if r.finish_s is not None
                                        and r.first_token_s is not None and r.output_len > 1],
                               50),
        tpot_p90_ms=percentile(tpot, 90),
        busy_imbalance=max(busy) / mean_busy if mean_busy else 0.0,
        load=mean_busy / end if end else 0.0, moved=moved_share(reqs),
        route_p99_ms=percentile(route_ms, 99), route_p50_ms=percentile(route_ms, 50),
        lookup_p99_ms=percentile(lookup_ms := [s * 1000 for s in timed.lookup_s], 99),
        sim_time_s=end, wall_s=wall, lookups_failed=timed.lookups_failed,
        index_failures=sim.index_failures,
        hash_p50_ms=percentile(hash_ms := [s * 1000 for s in timed.hash_s], 50),
        hash_p99_ms=percentile(hash_ms, 99), lookup_p50_ms=percentile(lookup_ms, 50),
        rank_p50_ms=percentile(rank_ms := [s * 1000 for s in timed.rank_s], 50),
        rank_p99_ms=percentile(rank_ms, 99),
        cpu_p50_ms=percentile(cpu_ms := [s * 1000 for s in timed.cpu_s], 50),
        cpu_p99_ms=percentile(cpu_ms, 99),
        redis_p50_ms=percentile(redis_ms := [s * 1000 for s in timed.redis_s], 50),
        redis_p99_ms=percentile(redis_ms, 99),
        work_p50_ms=percentile(work_ms := [c + r for c, r in zip(cpu_ms, redis_ms, strict=True)]
                                if redis_ms else [], 50),
        work_p99_ms=percentile(work_ms, 99),
        copy_mib=timed.copy_bytes / 2**20, router_rss_mib=timed.max_rss_bytes / 2**20)


def moved_share(requests: Sequence[SimRequest]) -> float:
    """Of the later chat turns, the share routed to another worker than the turn before."""
    worker = {r.key: r.worker for r in requests}
    later = [r for r in requests if r.after is not None and r.worker >= 0]
    return sum(r.worker != worker[r.after] for r in later) / len(later) if later else 0.0


def ceiling_for(served: Sequence[SimRequest], engine: SimEngine, num_workers: int | None,
                ) -> float:
    """The merged-cache ceiling of a cluster of ``num_workers`` engines like ``engine``, their
    pools and host tiers together (None: unlimited cache)."""
    ns = namespace(engine.model_fingerprint, None)
    bs = engine.block_size
    ordered = sorted(served, key=lambda r: (r.arrival_s, r.key))
    # a resent reply is cached too, but its last token (sampled, never fed back: no KV)
    held = [[*r.tokens, *r.reply[:-1]] if r.reply else r.tokens for r in ordered]
    chains = [hash_chain(tokens, bs, ns) for tokens in held]
    per_worker = engine.kv.num_total_blocks
    if engine.tiers is not None and engine.tiers.host is not None:
        per_worker += engine.tiers.host.num_slots
    blocks = sys.maxsize if num_workers is None else per_worker * num_workers
    return merged_ceiling(chains, [len(r.tokens) for r in ordered], blocks, bs,
                          [len(tokens) for tokens in held])


COLUMNS = (("policy", "policy", "{}"), ("workers", "workers", "{}"),
           ("hit_rate", "hit", "{:.3f}"), ("ceiling_hit_rate", "ceiling", "{:.3f}"),
           ("unlimited_hit_rate", "unlimited", "{:.3f}"), ("host_hit_share", "host share",
                                                           "{:.2f}"),
           ("ttft_p50_s", "TTFT p50 s", "{:.3f}"), ("ttft_p90_s", "p90", "{:.3f}"),
           ("ttft_p99_s", "p99", "{:.3f}"), ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
           ("tpot_p90_ms", "p90", "{:.1f}"), ("load", "load", "{:.2f}"),
           ("busy_imbalance", "busy max/mean", "{:.2f}"), ("moved", "moved", "{:.2f}"),
           ("route_p99_ms", "route p99 ms", "{:.2f}"), ("lookup_p99_ms", "lookup p99", "{:.2f}"),
           ("rejected", "rejected", "{}"),
           ("wall_s", "wall s", "{:.0f}"))


def table(results: Sequence[RunResult]) -> str:
    rows = [[label for _, label, _ in COLUMNS]]
    rows += [[fmt.format(getattr(r, name)) for name, _, fmt in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in rows)


def engine_config(args: argparse.Namespace, profile: SimProfile, num_blocks: int | None,
                  ) -> EngineConfig:
    """Each worker's engine: ``num_blocks`` in its pool (None: the profile's budget) and a host
    tier of ``--host-factor`` times that."""
    pool = num_blocks or profile.default_num_blocks(args.block_size)
    host_gib = args.host_factor * pool * profile.kv_bytes_per_token * args.block_size / 2**30
    return EngineConfig(
        block_size=args.block_size, num_blocks=num_blocks, kv_offloading_size=host_gib,
        max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens)


def distinct_blocks(requests: Sequence[SimRequest], block_size: int) -> int:
    """The workload's distinct full blocks: what an unlimited cache would end up holding."""
    ns = namespace("distinct", None)
    return len(set().union(*(hash_chain(r.tokens, block_size, ns) for r in requests)))


def load_requests(args: argparse.Namespace, profile: SimProfile) -> list[SimRequest]:
    if args.workload == "trace":
        return trace_requests(args.trace, profile.vocab_size, limit=args.limit,
                              speedup=args.speedup, max_input=args.max_input,
                              max_output=args.max_output)
    generated = workload(args.workload, dict(args.workload_option))
    return session_requests(generated.sessions(Tokens(profile.vocab_size, seed=args.seed)),
                            profile.vocab_size)


async def run_all(args: argparse.Namespace) -> tuple[list[RunResult], RoundTrips | None]:
    """The runs, and (where the prefix policy ran) what a Redis round trip costs here, to read
    the decision times against."""
    profile = profile_for(args.profile)
    requests = load_requests(args, profile)
    distinct = distinct_blocks(requests, args.block_size) if args.pool_fraction else 0
    redis = None
    redis_url = args.redis_url
    policies = [p.strip() for p in args.policy.split(",")]
    weights = PolicyConfig(**dict(args.weight))
    if "prefix" in policies and redis_url is None:
        redis = LocalRedis().start()
        redis_url = redis.url
    results = []
    try:
        for n in (int(x) for x in args.workers.split(",")):
            num_blocks = (max(1, round(args.pool_fraction * distinct / n))
                          if args.pool_fraction else args.num_blocks)
            config = engine_config(args, profile, num_blocks)
            ceiling = None
            for policy in policies:
                result = await simulate(requests, profile, n, policy, config, redis_url,
                                        publish_lag_s=args.publish_lag_ms / 1000,
                                        heartbeat_s=args.heartbeat_s, seed=args.seed,
                                        ceiling=ceiling, weights=weights,
                                        router=dict(args.router),
                                        router_process=args.router_process,
                                        local_index=args.local_index)
                ceiling = result.ceiling_hit_rate
                results.append(result)
                print(table([result]).splitlines()[-1], file=sys.stderr, flush=True)
        trips = (await asyncio.to_thread(measure_round_trips, redis_url)
                 if "prefix" in policies else None)
    finally:
        if redis is not None:
            redis.close()
    return results, trips


def _named_value(text: str, flag: str, names: Sequence[str]) -> tuple[str, str]:
    """``NAME=VALUE`` with NAME one of ``names``, as argparse wants a bad one refused."""
    name, sep, value = text.partition("=")
    if not sep or name not in names:
        raise argparse.ArgumentTypeError(
            f"{flag} takes NAME=VALUE with NAME one of {', '.join(names)}")
    return name, value


def parse_weight(text: str) -> tuple[str, float]:
    name, value = _named_value(text, "--weight", sorted(WEIGHT_NAMES))
    return name, float(value)


def parse_fraction(text: str) -> float:
    """A share of the workload's distinct blocks: a number, at least 0 (0: not used)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def parse_option(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError("--workload-option takes NAME=VALUE")
    return name, value


ROUTER_SETTINGS = ("max_match_tokens", "hash_memo_tokens")


def parse_router_setting(text: str) -> tuple[str, int]:
    name, value = _named_value(text, "--router", ROUTER_SETTINGS)
    return name, int(value)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64", help="comma-separated cluster sizes")
    parser.add_argument("--policy", default=",".join(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--workload", default="trace", choices=("trace", *WORKLOADS),
                        help="replay --trace, or generate chat users or Zipf-popular groups "
                        "(bench.sim.workloads)")
    parser.add_argument("--workload-option", action="append", default=[], metavar="NAME=VALUE",
                        type=parse_option,
                        help="a generated workload's field, e.g. rate=2.5 or answer_len=128-384, "
                        "repeatable")
    parser.add_argument("--trace", default="bench/traces/mooncake_conversation_1000.jsonl",
                        help="a Mooncake-format JSONL trace (the full traces: a path)")
    parser.add_argument("--limit", type=int, default=None, help="first N rows only")
    parser.add_argument("--speedup", type=float, default=1.0, help="arrivals at timestamp/x")
    parser.add_argument("--max-input", type=int, default=None, help="cut prompts to N tokens")
    parser.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    parser.add_argument("--profile", default="h100-llama3-8b", help="sim:<profile> or <profile>")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks per worker (default: the profile's KV budget)")
    parser.add_argument("--pool-fraction", type=parse_fraction, default=0.0,
                        help="size the pools to hold together this fraction of the workload's "
                        "distinct blocks (over --num-blocks)")
    parser.add_argument("--host-factor", type=float, default=0.0,
                        help="a host KV tier per worker of this many times its pool (0: none)")
    parser.add_argument("--publish-lag-ms", type=float, default=5.0,
                        help="from a step's end to its KV events in the index")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="load report interval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight", action="append", default=[], metavar="NAME=VALUE",
                        type=parse_weight,
                        help="a prefix-policy weight (router.policy.PolicyConfig), repeatable")
    parser.add_argument("--router", action="append", default=[], metavar="NAME=VALUE",
                        type=parse_router_setting,
                        help="a RouterSettings field, e.g. max_match_tokens=16384, repeatable")
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--router-process", action="store_true",
                        help="run the router in a process of its own, as a live one runs in "
                        "the ingress's, not between the simulated fleet's steps (the same "
                        "decisions; their times without the fleet's cache traffic)")
    parser.add_argument("--local-index", action="store_true",
                        help="answer the prefix policy's lookups in process, from a follower of "
                        "the index's event log (IndexSettings.event_log), as the request router "
                        "does when the log is on; caught up before each decision (with "
                        "--router-process, in the router's process, which then reports its "
                        "peak resident memory)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.workload != "trace":
        try:
            workload(args.workload, dict(args.workload_option))
        except (ValueError, TypeError) as e:
            parser.error(str(e))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as Ray runs Serve's
        results, trips = runner.run(run_all(args))
    print(table(results))
    for result in results:
        if result.policy == "prefix":
            print(result.parts())
            print(result.work())
            if result.copy_mib:
                print(result.memory())
    if trips is not None:
        print(trips.line())
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"args": vars(args), "runs": [asdict(r) for r in results],
             "round_trips": asdict(trips) if trips is not None else None}, indent=2))


if __name__ == "__main__":
    main()
