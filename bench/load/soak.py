"""Soak test: thousands of mixed requests, then check that nothing leaked.

    python -m prefixserve.bench.load.soak --requests 3000 --concurrency 16 --num-blocks 48

starts a private cluster (Redis, Ray, two CPU workers with a small KV cache so the scheduler
preempts), sends a mix of streaming and non-streaming completions with shared prefixes, ``n=2``
samples and client disconnects at random points, then checks, once the cluster is idle:

* blocks: every worker has ``free == total`` blocks and nothing running or waiting;
* index: each live worker's entries in Redis equal its engine's cached block set, and no
  predicted or dead-worker keys are left behind;
* memory: each worker's RSS grew by less than a bound since the warm-up.

The pieces (:class:`LoadStream`, :func:`run_soak`, :func:`check_leaks`) are shared with the
fault-injection tests (``tests/test_faults_cluster.py``), which run a short version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from prefixserve.bench.load.client import WORKER_HEADER
from prefixserve.bench.load.sse import DONE, SSEParser
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

OK, CLEAN_ERROR, FAILED, HUNG, CANCELLED = "ok", "clean_error", "failed", "hung", "cancelled"
VOCAB = 250


@dataclass
class Outcome:
    kind: str  # OK | CLEAN_ERROR | FAILED | HUNG | CANCELLED
    started: float  # time.monotonic()
    ended: float
    status: int = 0
    detail: str = ""
    worker: str = ""


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    stream: bool
    n: int = 1
    cancel_after: int | None = None  # close the connection after this many SSE events


def random_spec(rng: random.Random, prefixes: list[list[int]], cancel_frac: float = 0.2,
                max_tokens: int = 32) -> Spec:
    prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
    prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 48))]
    stream = rng.random() < 0.7
    cancel = rng.randrange(0, 8) if stream and rng.random() < cancel_frac else None
    return Spec(prompt, rng.randrange(1, max_tokens + 1), stream,
                n=2 if rng.random() < 0.1 else 1, cancel_after=cancel)


def make_prefixes(seed: int, count: int = 6, tokens: int = 160) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(tokens)] for _ in range(count)]


async def send(client: httpx.AsyncClient, base_url: str, spec: Spec,
               timeout_s: float = 60.0) -> Outcome:
    """One request, classified. A stream that ends with an ``error`` event then ``[DONE]`` (or a
    JSON error envelope with a 4xx/5xx) is a clean error; no answer within ``timeout_s`` is hung.
    """
    body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.7,
            "ignore_eos": True, "n": spec.n, "stream": spec.stream}
    start = time.monotonic()

    async def go() -> Outcome:
        if not spec.stream:
            r = await client.post(f"{base_url}/v1/completions", json=body)
            worker = r.headers.get(WORKER_HEADER, "")
            if r.status_code == 200 and len(r.json()["choices"]) == spec.n:
                return Outcome(OK, start, time.monotonic(), 200, worker=worker)
            kind = CLEAN_ERROR if _is_envelope(r.content) else FAILED
            return Outcome(kind, start, time.monotonic(), r.status_code, r.text[:200], worker)
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            worker = r.headers.get(WORKER_HEADER, "")
            if r.status_code != 200:
                raw = await r.aread()
                kind = CLEAN_ERROR if _is_envelope(raw) else FAILED
                return Outcome(kind, start, time.monotonic(), r.status_code, raw[:200].decode(),
                               worker)
            return await classify_stream(r, spec, start, worker)

    try:
        return await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        return Outcome(HUNG, start, time.monotonic(), detail=f"no answer in {timeout_s:.0f}s")
    except httpx.HTTPError as exc:
        return Outcome(FAILED, start, time.monotonic(), detail=f"{type(exc).__name__}: {exc}")


async def classify_stream(r: httpx.Response, spec: Spec, start: float, worker: str) -> Outcome:
    """Classify a 200 stream by its events, split into lines as SSE says (CR or LF only)."""
    parser, events, error, finished = SSEParser(), 0, "", 0
    async for raw in r.aiter_bytes():
        for payload in parser.feed(raw):
            if spec.cancel_after is not None and events >= spec.cancel_after:
                return Outcome(CANCELLED, start, time.monotonic(), 200, worker=worker)
            events += 1
            if payload == DONE:
                if error:
                    return Outcome(CLEAN_ERROR, start, time.monotonic(), 200, error, worker)
                if finished == spec.n:
                    return Outcome(OK, start, time.monotonic(), 200, worker=worker)
                return Outcome(FAILED, start, time.monotonic(), 200,
                               f"[DONE] after {finished}/{spec.n} finished choices", worker)
            try:
                chunk = json.loads(payload)
            except ValueError:
                return Outcome(FAILED, start, time.monotonic(), 200,
                               f"malformed event: {payload[:160]!r}", worker)
            if "error" in chunk:
                error = json.dumps(chunk["error"])[:200]
                continue
            finished += sum(1 for c in chunk["choices"] if c.get("finish_reason"))
    if spec.cancel_after is not None:
        return Outcome(CANCELLED, start, time.monotonic(), 200, worker=worker)
    return Outcome(FAILED, start, time.monotonic(), 200, "stream ended without [DONE]", worker)


def _is_envelope(raw: bytes) -> bool:
    try:
        err = json.loads(raw)["error"]
        return isinstance(err, dict) and "message" in err
    except (ValueError, KeyError, TypeError):
        return False


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    counts = Counter(o.kind for o in outcomes)
    lat = sorted(o.ended - o.started for o in outcomes if o.kind == OK)
    return {
        "sent": len(outcomes),
        **{k: counts.get(k, 0) for k in (OK, CANCELLED, CLEAN_ERROR, FAILED, HUNG)},
        "p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "max_s": round(lat[-1], 3) if lat else None,
        "errors": sorted({o.detail for o in outcomes if o.kind in (FAILED, CLEAN_ERROR, HUNG)})[:5],
    }


async def run_soak(base_url: str, num_requests: int, concurrency: int = 16, seed: int = 0,
                   cancel_frac: float = 0.2, max_tokens: int = 32,
                   timeout_s: float = 60.0) -> list[Outcome]:
    rng = random.Random(seed)
    prefixes = make_prefixes(seed)
    specs = [random_spec(rng, prefixes, cancel_frac, max_tokens) for _ in range(num_requests)]
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                outcomes.append(await send(client, base_url, queue.get_nowait(), timeout_s))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


class LoadStream:
    """A steady stream of requests from a background thread, at most ``max_requests``.

    ``outcomes`` fills as they complete; :meth:`stop` ends it and waits for those in flight.
    """

    def __init__(self, base_url: str, concurrency: int = 4, max_requests: int = 400,
                 seed: int = 1, cancel_frac: float = 0.0, max_tokens: int = 12,
                 timeout_s: float = 60.0, stream_frac: float | None = None) -> None:
        self.base_url = base_url
        self.concurrency = concurrency
        self.max_requests = max_requests
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._rng = random.Random(seed)
        self._prefixes = make_prefixes(seed)
        self._cancel_frac = cancel_frac
        self._max_tokens = max_tokens
        self._stream_frac = stream_frac
        self._sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> LoadStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(self.timeout_s + 30)
        assert not self._thread.is_alive(), "load stream did not stop"
        return self.outcomes

    def since(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started >= t]

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            async def worker() -> None:
                while not self._stop.is_set() and self._sent < self.max_requests:
                    self._sent += 1
                    spec = random_spec(self._rng, self._prefixes, self._cancel_frac,
                                       self._max_tokens)
                    if self._stream_frac is not None:
                        spec.stream = self._rng.random() < self._stream_frac
                    self.outcomes.append(await send(client, self.base_url, spec, self.timeout_s))
                    await asyncio.sleep(0.02)

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))


# -- leak checks ------------------------------------------------------------------------------


def worker_ids(app_name: str) -> list[str]:
    """Replica unique ids of the app's live LLMWorker actors (named ``SERVE_REPLICA::...``)."""
    import ray

    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith("SERVE_REPLICA::") and f"{app_name}#LLMWorker#" in name:
            out.append(name.rsplit("#", 1)[1])
    return sorted(out)


def worker_stats(app_name: str, timeout_s: float = 15.0) -> dict[str, dict[str, Any]]:
    from ray import serve

    handle = serve.get_deployment_handle("LLMWorker", app_name)
    return {w: handle.stats.remote(target_worker=w).result(timeout_s=timeout_s)
            for w in worker_ids(app_name)}


def wait_idle(app_name: str, timeout_s: float = 30.0) -> tuple[bool, dict[str, dict], float]:
    """Poll until every worker has all blocks free and nothing running; (ok, stats, seconds)."""
    start = time.monotonic()
    stats: dict[str, dict] = {}
    while time.monotonic() - start < timeout_s:
        stats = worker_stats(app_name)
        if stats and all(s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0
                         and s["num_waiting"] == 0 for s in stats.values()):
            return True, stats, time.monotonic() - start
        time.sleep(0.3)
    return False, stats, time.monotonic() - start


def index_view(redis_url: str, model: str) -> dict[str, Any]:
    """What Redis holds for the model: per worker id its block set (the block hash's keys: each
    digest's first ``router.redis_index.INDEX_KEY_BYTES``), and the other keys."""
    import redis

    from prefixserve.router.redis_records import key_tag

    p = "{" + key_tag(model) + "}"
    r = redis.Redis.from_url(redis_url)
    try:
        blocks: dict[int, set[bytes]] = {}
        for digest, holders in r.hgetall(p + "B").items():
            for k in range(0, len(holders), 2):
                blocks.setdefault(int.from_bytes(holders[k:k + 2], "big"), set()).add(digest)
        keys = [k.decode(errors="replace") for k in r.keys(p + "*")]
        return {
            "blocks": blocks,
            "predicted_keys": sum(1 for k in keys if k.startswith(p + "q")),
            "worker_keys": sorted(k for k in keys if k.startswith((p + "w:", p + "r:"))),
            "registered": sorted((int(x) if x.isdigit() else x.decode(errors="replace")
                                  for x in r.smembers(p + "reg")), key=str),
            "total_keys": len(keys),
        }
    finally:
        r.close()


def check_leaks(app_name: str, redis_url: str | None, model: str,
                rss_before: dict[str, int] | None = None, rss_growth_bound: int = 256 << 20,
                timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait for idle, then compare blocks, index and RSS. Returns a report with ``problems``."""
    from ray import serve

    from prefixserve.router.index import INDEX_KEY_BYTES

    problems: list[str] = []
    idle, stats, idle_s = wait_idle(app_name, timeout_s)
    if not idle:
        problems.append(f"workers not idle after {timeout_s}s: " + str(
            {w: (s["num_free_blocks"], s["num_total_blocks"], s["num_running"])
             for w, s in stats.items()}))
    report: dict[str, Any] = {"idle_after_s": round(idle_s, 2), "workers": {}}
    handle = serve.get_deployment_handle("LLMWorker", app_name)
    for w, s in stats.items():
        report["workers"][w] = {"free": s["num_free_blocks"], "total": s["num_total_blocks"],
                                "preemptions": s["num_preemptions"],
                                "rss_mib": s["rss_bytes"] >> 20}
        if rss_before and w in rss_before:
            growth = s["rss_bytes"] - rss_before[w]
            report["workers"][w]["rss_growth_mib"] = growth >> 20
            if growth > rss_growth_bound:
                problems.append(f"{w}: RSS grew by {growth >> 20} MiB")
    if redis_url:
        deadline = time.monotonic() + timeout_s
        while True:  # events are published asynchronously and predictions expire: converge
            view = index_view(redis_url, model)
            diffs = {}
            for w, s in stats.items():
                cached = {h[:INDEX_KEY_BYTES] for h in handle.cached_block_hashes.remote(
                    target_worker=w).result(timeout_s=15)}
                indexed = view["blocks"].get(s["worker_id"], set())
                if cached != indexed:
                    diffs[w] = (len(cached), len(indexed), len(cached ^ indexed))
            live_ids = {s["worker_id"] for s in stats.values()}
            extra_ids = set(view["blocks"]) - live_ids
            stale = view["predicted_keys"] or extra_ids or set(view["registered"]) - live_ids
            if (not diffs and not stale) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        report["index"] = {"total_keys": view["total_keys"],
                           "entries": {w: len(b) for w, b in view["blocks"].items()},
                           "predicted_keys": view["predicted_keys"],
                           "registered": view["registered"]}
        if diffs:
            problems.append(f"index != cached sets (cached, indexed, differing): {diffs}")
        if view["predicted_keys"]:
            problems.append(f"{view['predicted_keys']} predicted keys never expired")
        if extra_ids:
            problems.append(f"entries of unknown/dead worker ids {sorted(extra_ids)}")
        if set(view["registered"]) - live_ids:
            problems.append(f"registered ids without a live worker: {view['registered']}")
    report["problems"] = problems
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixserve.bench.load.soak",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--cancel-frac", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-bound-mib", type=int, default=256)
    ap.add_argument("--model", default=BUILTIN_MODEL_NAME,
                    help="what the cluster serves (the machinery, not the answers, is tested)")
    args = ap.parse_args(argv)

    from prefixserve.bench.load.launch import APP_NAME, local_cluster, shutdown

    try:
        with local_cluster(model=args.model, num_workers=args.num_workers,
                           num_blocks=args.num_blocks,
                           max_num_seqs=16, lease_ttl_s=3.0) as launched:
            warm = asyncio.run(run_soak(launched.base_url, 32, args.concurrency, seed=10**6))
            rss = {w: s["rss_bytes"] for w, s in wait_idle(APP_NAME)[1].items()}
            t0 = time.monotonic()
            outcomes = asyncio.run(run_soak(launched.base_url, args.requests, args.concurrency,
                                            seed=args.seed, cancel_frac=args.cancel_frac,
                                            max_tokens=args.max_tokens))
            elapsed = time.monotonic() - t0
            report = check_leaks(APP_NAME, launched.config.redis_url, launched.model, rss,
                                 args.rss_bound_mib << 20)
    finally:
        shutdown()
    summary = {"warmup": summarize(warm), "soak": summarize(outcomes),
               "elapsed_s": round(elapsed, 1), **report}
    print(json.dumps(summary, indent=2, default=str))
    s = summary["soak"]
    bad = s[FAILED] + s[HUNG] + s[CLEAN_ERROR] + len(report["problems"])
    print("SOAK", "PASSED" if not bad else "FAILED", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
