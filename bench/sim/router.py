"""The router's side of the simulated cluster (:mod:`bench.sim.simulate`): each policy's decision
for a request, timed, in the simulator's process or in a process of its own.

In the simulator's process every decision runs between the simulated fleet's steps, event
flushes and heartbeats, which leave the CPU caches cold; a live router shares its process with
the ingress only. :class:`RouterProcess` runs the same :class:`SimRouter` in a child process
with its own index connection, in lock step: the simulator waits for each decision, so
simulated time and the decisions are exactly those of the in-process run. Where the router
gets a core of its own, its decisions are timed without the fleet's work between them (on a
2-vCPU machine the two share the cores, and the figures come out the same either way). With the
event log followed, the process keeps its own follower, caught up before each decision outside
its timing, and reports its peak resident memory: what a router following the fleet holds.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import uvloop
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

from prefixserve.bench.micro.redis_time import lookup_clock
from prefixserve.bench.micro.router_copy import footprint
from prefixserve.router.decision import LookupSource, RoutingCore
from prefixserve.router.decision_types import Candidate
from prefixserve.router.index import IndexSettings, PrefixIndex
from prefixserve.router.index_follower import IndexFollower, event_logs
from prefixserve.router.index_stores import open_index
from prefixserve.router.ray_prefix import TOKEN_CHAR_BASE
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState

POLICIES = ("prefix", "pow2", "round_robin", "ray_prefix")
RAY_MATCH_RATE_THRESHOLD = 0.1  # PrefixCacheAffinityRouter's default
GC_EVERY_DECISIONS = 1000  # a router process collects between decisions this often


def check_policy(policy: str, index: object | None) -> None:
    """ValueError for an unknown policy, or the prefix policy without an index."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    if policy == "prefix" and index is None:
        raise ValueError("the prefix policy needs an index")


@dataclass
class Timings:
    """Per decision, in seconds: wall time, the router's CPU time and Redis' own time running
    its lookups; per part: hashing the chain a decision starts with, each lookup, ranking."""

    route_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # this thread's, so no waits
    redis_s: list[float] = field(default_factory=list)  # prefix only
    hash_s: list[float] = field(default_factory=list)
    lookup_s: list[float] = field(default_factory=list)
    rank_s: list[float] = field(default_factory=list)
    lookups_failed: int = 0
    copy_bytes: int = 0  # the follower's copy of the index, at the end (local lookups only)
    max_rss_bytes: int = 0  # a router process's peak resident memory (0: in process)


class SimRouter:
    """One policy routing to workers known by name; a decision returns the worker's index.

    ``index_deadline_s``: the index client's deadline; ``redis_time`` (prefix): Redis' own ms
    running the lookups since its last call, read after each decision, outside its timing;
    ``local`` (prefix): answer the lookups in process instead, from a follower of the index's
    event log (:class:`router.index_follower.IndexFollower`), as the request router does."""

    def __init__(self, policy: str, names: Sequence[str], index: PrefixIndex | None,
                 settings: RouterSettings, *, index_deadline_s: float, seed: int = 0,
                 redis_time: Callable[[], float] | None = None,
                 local: IndexFollower | None = None) -> None:
        check_policy(policy, index)
        self.policy = policy
        self.names = list(names)
        self.at = {name: i for i, name in enumerate(self.names)}
        self.index = index if policy == "prefix" else None
        self.state = RouterState(settings)
        self.rng = random.Random(seed)
        self.tree = PrefixTree()  # ray_prefix's
        self.tree.add_tenants(self.names, 0.0)
        self.local = local if self.index is not None else None
        # the Serve request router's decision, through the same code
        self.core = RoutingCore(self.state, LookupSource(
            self.state, self.index, self.local, index_deadline_s))
        self.redis_time = redis_time if self.index is not None and local is None else None
        self.timings = Timings()
        self._rr = itertools.cycle(range(len(self.names)))
        self._candidates = [Candidate(name) for name in self.names]

    async def start(self) -> None:
        """Adopt the registered workers (prefix): their block size and model fingerprint."""
        if self.index is not None:
            candidates = [Candidate(name) for name in self.names]
            self.state.gate.check_workers(await self.index.live_workers(), candidates, 0.0)

    async def route(self, key: int, tokens: Sequence[int], ongoing: Sequence[int],
                    now: float) -> int:
        """The worker for request ``key``; ``ongoing``: each worker's requests in flight."""
        t = self.timings
        cpu, start = time.thread_time(), time.perf_counter()
        if self.policy == "round_robin":
            chosen = next(self._rr)
        elif self.policy == "pow2":
            n = len(self.names)
            a, b = self.rng.sample(range(n), 2) if n > 1 else (0, 0)
            chosen = a if ongoing[a] <= ongoing[b] else b
        elif self.policy == "ray_prefix":
            chosen = self._ray_prefix(tokens, ongoing, now)
        else:
            chosen = await self._rank(key, tokens, ongoing, now)
        t.route_s.append(time.perf_counter() - start)
        t.cpu_s.append(time.thread_time() - cpu)  # nothing else runs while a decision waits
        if self.redis_time is not None:
            t.redis_s.append(self.redis_time() / 1000)
        if self.policy == "prefix":  # after the decision, as Serve's on_request_routed
            self.core.sent(key, self.names[chosen], str(key), now)
        return chosen

    def completed(self, worker: int, key: int) -> None:
        self.core.completed(self.names[worker], str(key))

    async def close(self) -> None:
        """Record the follower copy's size (the index is the caller's)."""
        if self.local is not None:
            self.timings.copy_bytes = footprint(self.local.held)

    def _ray_prefix(self, tokens: Sequence[int], ongoing: Sequence[int], now: float) -> int:
        """PrefixCacheAffinityRouter's choice (load balanced: its default threshold is inf)."""
        text = "".join(chr(TOKEN_CHAR_BASE + t) for t in tokens)
        matched, holders = self.tree.prefix_match(text, self.names)
        if len(matched) < RAY_MATCH_RATE_THRESHOLD * len(text):
            holders = self.tree.get_smallest_tenants()
        candidates = [self.at[name] for name in holders or self.names]
        chosen = min(candidates, key=lambda i: ongoing[i])  # Serve: the shortest queue, first
        self.tree.insert(text, self.names[chosen], now)
        return chosen

    async def _rank(self, key: int, tokens: Sequence[int], ongoing: Sequence[int],
                    now: float) -> int:
        candidates = self._candidates  # the same replicas: their queue lengths change
        for candidate, queue_len in zip(candidates, ongoing, strict=True):
            candidate.queue_len = queue_len
        decision = await self.core.decide(key, tokens, None, candidates, str(key), now)
        t = self.timings
        t.hash_s.append(decision.hash_s)
        t.rank_s.append(decision.rank_s)
        for attempt in decision.lookups:
            if attempt.source is None:
                continue
            if attempt.failopen is None:
                t.lookup_s.append(attempt.seconds)
            else:
                t.lookups_failed += 1
        return self.at[decision.best]


@dataclass(frozen=True)
class IndexSpec:
    """Where a router process finds the index: its own connection to it."""

    url: str | None  # None: no index (every policy but prefix)
    model: str
    settings: IndexSettings
    deadline_s: float
    follow_log: int = 0  # > 0: answer lookups from a follower of the event log, this long


@dataclass(frozen=True)
class RouterSpec:
    """What a router process needs to build its :class:`SimRouter`."""

    policy: str
    names: tuple[str, ...]
    settings: RouterSettings
    seed: int
    index: IndexSpec


class RouterProcess:
    """A :class:`SimRouter` in a child process (spawned: no state shared with the simulator),
    driven in lock step over a pipe. Completions ride with the next decision, in order."""

    def __init__(self, spec: RouterSpec) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child, args=(child, spec), daemon=True)
        self._process.start()
        child.close()
        self._done: list[tuple[int, int]] = []
        self._answering = True  # until it sent its timings or an exception
        self.timings = Timings()

    def _call(self, *message: Any) -> Any:
        try:
            self._conn.send(message)
            reply = self._conn.recv()
        except BaseException:  # the child is gone (or going): nothing more to ask it
            self._answering = False
            raise
        if isinstance(reply, BaseException):
            self._answering = False
            raise reply
        return reply

    async def start(self) -> None:
        self._call("start")

    async def route(self, key: int, tokens: Sequence[int], ongoing: Sequence[int],
                    now: float) -> int:
        done, self._done = self._done, []
        return self._call("route", key, tokens, ongoing, now, done)

    def completed(self, worker: int, key: int) -> None:
        self._done.append((worker, key))

    async def close(self) -> None:
        """Stop the child; its timings become this object's."""
        if self._answering:
            self._answering = False
            self.timings = self._call("close")
        self._process.join(10)
        self._conn.close()


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started its program (VmHWM; not
    ru_maxrss, which a spawned child inherits from the fork it was exec'ed from)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(conn: Connection, spec: RouterSpec) -> None:
    uvloop.run(_serve(conn, spec))  # as Ray runs Serve's


async def _serve(conn: Connection, spec: RouterSpec) -> None:
    where, index, local = spec.index, None, None
    if where.url is not None:
        index = open_index(where.url, where.model, deadline_s=where.deadline_s,
                           settings=where.settings)
        if where.follow_log:
            logs = event_logs(index)
            assert logs is not None, "the index keeps no event log"
            local = IndexFollower(index, logs, log_entries=where.follow_log)
    try:
        with lookup_clock(None if local else where.url) as redis_time:
            router = SimRouter(spec.policy, spec.names, index, spec.settings,
                               index_deadline_s=where.deadline_s, seed=spec.seed,
                               redis_time=redis_time, local=local)
            await _answer(conn, router)
    finally:
        if index is not None:
            await index.close()
        conn.close()


async def _answer(conn: Connection, router: SimRouter) -> None:
    """Answer the simulator's messages until it closes; the collector runs between decisions,
    as in the simulator's own process."""
    decisions = 0
    gc.disable()
    while True:
        kind, *args = conn.recv()
        try:
            if kind == "start":
                await router.start()
                gc.collect()
                gc.freeze()
                reply: Any = None
            elif kind == "route":
                *request, done = args
                for worker, key in done:
                    router.completed(worker, key)
                if router.local is not None:  # what the simulator applied by now
                    await router.local.catch_up()
                reply = await router.route(*request)
                decisions += 1
                if decisions % GC_EVERY_DECISIONS == 0:
                    gc.collect(1)
            else:
                await router.close()
                router.timings.max_rss_bytes = peak_rss_bytes()
                conn.send(router.timings)
                return
        except Exception as exc:  # the simulator re-raises it
            conn.send(exc)
            return
        conn.send(reply)
