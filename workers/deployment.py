"""`LLMWorker`: the Ray Serve replica that owns one engine (one per GPU, or a CPU share).

Threads. The engine is not thread-safe, so one loop thread (`workers.engine_loop.EngineLoop`)
owns it and hands each step's outputs to the waiting ``generate`` streams. An error in one
request (bad input) fails that request only; an exception inside a step fails the requests that
step ran (their blocks are freed, the cache entries it was writing are withdrawn and the index
told) and the loop goes on.

Index. When a Redis URL is given the replica registers (Serve replica id, a fresh time-based
epoch, block size, model fingerprint, node) and runs an ``EventPublisher`` that ships the
engine's KV events, keeps the lease with heartbeats carrying the engine-reported load, and
resyncs the full block set after an outage. Redis being down never stops serving, and
``check_health`` never touches it.

Health and shutdown. ``check_health`` fails when the engine loop has died or one round of work
(a step) has run for ``stall_timeout_s``: a hung step would otherwise hold every request on this
replica while Serve kept routing to it. ``__del__`` (Serve's graceful shutdown hook) drains:
in-flight streams get up to ``drain_timeout_s`` to finish, the rest are aborted (their blocks
freed, their streams ended with "abort"), then the loop stops and the replica deregisters.

Metrics: vLLM-named series, `workers.worker_metrics`. Serve options (replicas, ``num_cpus``,
``num_gpus``, the request router) are set by whoever wraps this class with ``serve.deployment``;
:func:`worker_deployment` is the usual way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from functools import partial
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from prefixserve.router.adapter_slots import SlotReport
from prefixserve.router.events import KVEvent, WorkerLoad
from prefixserve.router.index import IndexSettings
from prefixserve.router.index_stores import open_index
from prefixserve.router.publisher import EventPublisher
from prefixserve.router.request import GenerateRequest, TokenDelta
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.router.secret_refs import resolve
from prefixserve.workers import placement
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_loop import (
    NOTHING,
    EngineLoop,
    OutputStream,
    drain_steps,
    next_within,
    to_deltas,
)
from prefixserve.workers.engine_types import EngineConfig, RequestOutput
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.index_truth import IndexTruth
from prefixserve.workers.model_sources import model_source
from prefixserve.workers.structured import compile_in_thread
from prefixserve.workers.worker_metrics import WorkerMetrics

log = logging.getLogger("ray.serve")

STALL_TIMEOUT_S = 60.0  # far above any one step's time, even a long CPU prefill
KEEPALIVE_S = 2.0  # a silent stream's keepalive period: well under the ingress's deadline
DEREGISTER_TIMEOUT_S = 2.0
ABORT_GRACE_S = 1.0  # for aborted streams' consumers to take their final "abort" delta


class LLMWorker:
    """One engine behind a Serve replica. See the module docstring for the threading model."""

    async def __init__(
        self,
        model: str,
        engine: EngineConfig | dict[str, Any],
        redis_url: str | None,
        model_name: str,
        *,
        stream_interval: int,
        drain_timeout_s: float,
        index: IndexSettings | dict[str, Any] | None = None,
        heartbeat_interval_s: float = 1.0,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        """
        Args:
            model: what `--model` names (`workers.checkpoints`), resolved on this node.
            engine: the engine section (``workers.engine_types.EngineConfig``, or its fields);
                ``device`` ``auto`` is the GPU Ray assigned, else CPU.
            redis_url: the prefix index, or a reference to it (``env:NAME``, ``file:/path``,
                resolved here); None serves without publishing.
            model_name: served model name: the index keyspace, shared with the router.
            index: the index section (``router.index.IndexSettings``): lease, deadlines.
            heartbeat_interval_s: how often load is reported and the lease renewed.
            stream_interval: engine steps per streamed delta after the first token (SGLang's
                ``--stream-interval``); the first token always goes out at once.
            drain_timeout_s: how long a stopping replica lets in-flight streams finish before
                aborting them: the deployment's ``graceful_shutdown_timeout_s``.
            stall_timeout_s: how long one round of engine work may run before Serve restarts it.
            keepalive_s: a stream silent this long gets a keepalive delta (the ingress's
                progress deadline then tells a busy worker from a stopped one).
        """
        if stream_interval < 1 or drain_timeout_s < 0 or stall_timeout_s <= 0 or keepalive_s <= 0:
            raise ValueError("stream_interval must be >= 1, drain_timeout_s >= 0, "
                             "stall_timeout_s and keepalive_s > 0")
        self.replica_id = placement.replica_id()
        self.model_name = model_name
        self._stream_interval = stream_interval
        self._ids = itertools.count()
        self._closed = False
        self._drain_timeout_s = drain_timeout_s
        self._stall_timeout_s = stall_timeout_s
        self._keepalive_s = keepalive_s
        self._inflight: set[str] = set()  # generate calls whose stream has not ended
        self._drained = asyncio.Event()  # set while nothing is in flight
        self._drained.set()
        self._publisher: EventPublisher | None = None
        self._tasks: list[asyncio.Task] = []
        self.epoch = time.time_ns() // 1000  # microseconds: a restart always gets a larger one

        index_url = resolve(redis_url) if redis_url else None  # fails before loading anything
        config = EngineConfig.model_validate(engine)
        config = config.model_copy(update={"device": placement.device_for(config.device)})
        index = IndexSettings.model_validate(index or {})
        self._loop = asyncio.get_running_loop()
        if config.device == "cpu":
            log.info("%d torch threads: the replica's CPUs", placement.use_replica_cpus())
        self.engine = await asyncio.to_thread(
            model_source(model).load_engine, model, config, self._on_kv_events
        )
        self.block_size = self.engine.block_size
        self.fingerprint = self.engine.model_fingerprint
        self._truth = IndexTruth(self.fingerprint, self.block_size)  # how true the index is
        self._loop_thread = EngineLoop(self.engine)
        self._loop_thread.start()
        self._metrics = WorkerMetrics(self.replica_id, self.model_name)
        self._tasks.append(self._loop.create_task(self._metrics_loop()))
        if index_url:
            self._publisher = EventPublisher(
                open_index(index_url, model_name, deadline_s=index.publish_deadline_s,
                           settings=index),
                replica_id=self.replica_id,
                epoch=self.epoch,
                block_size=self.block_size,
                fingerprint=self.fingerprint,
                snapshot=self._snapshot,
                load=self.load,
                node=placement.node_id(),
                heartbeat_interval_s=heartbeat_interval_s,
                # A dead replica's entries go soon after its lease lapses, not 30 s later.
                gc_interval_s=min(30.0, max(1.0, index.lease_ttl_s)),
                on_lag=self._metrics.index_lag)
            # Registers (retrying while Redis is down), publishes, heartbeats, resyncs.
            self._publisher.start()
        log.info(
            "LLMWorker %s ready: model %r on %s (%s), block_size=%d fingerprint=%s index=%s",
            self.replica_id, model_name, config.device, self.engine.describe_compute(),
            self.block_size, self.fingerprint, "on" if index_url else "off",
        )

    # ---------------------------------------------------------------------------- serving

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream this request's tokens: per sample, one delta per engine step (the first step
        alone, at once; later ones every ``stream_interval`` steps, a consumer's backlog as one).

        Raises InvalidRequestError for bad input. If the caller goes away (the generator is
        closed or cancelled), the request is aborted and its blocks are freed.
        """
        params = request.sampling
        if not isinstance(params, SamplingParams):  # validated once, by the engine
            raise InvalidRequestError("sampling must be a SamplingParams")
        self._require_loop()
        if self._closed:
            raise RuntimeError(f"worker {self.replica_id} is shutting down")
        grammar = None if params.structured is None else await compile_in_thread(
            getattr(self.engine, "compile", None), params)  # on a thread, not the engine loop
        if request.lora is not None and hasattr(self.engine, "prefetch_lora"):  # likewise
            await asyncio.to_thread(self.engine.prefetch_lora, request.lora, request.lora_path)
        request_id = f"{request.request_id}#{next(self._ids)}"
        stream = OutputStream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        timing = self._metrics.request(time.perf_counter(), params.n, None if request.expected
                                       is None else partial(self._truth.judge, request))
        last: float | None = None
        finished = 0
        self._inflight.add(request_id)
        self._drained.clear()
        self._loop_thread.add(
            request_id, request.prompt_token_ids, params, request.cache_salt, stream,
            request.tenant, grammar, request.lora, request.lora_path,
        )
        held: list[list[RequestOutput]] = []  # steps not streamed yet (stream_interval > 1)
        try:
            while finished < params.n:
                first = await next_within(stream.queue, self._keepalive_s)
                if first is NOTHING:
                    yield TokenDelta.alive(self.replica_id)
                    continue
                steps, error = drain_steps(first, stream.queue, backlog=last is not None)
                held += steps
                if (error is None and last is not None and len(held) < self._stream_interval
                        and not any(o.finished for step in held for o in step)):
                    continue
                now = time.perf_counter()
                deltas = to_deltas(held, self.replica_id)
                if any(d.token_ids for d in deltas):
                    last = now
                timing.delivered(now, deltas, stream.scheduled_at)
                for delta in deltas:
                    finished += delta.finished
                    yield delta
                held = []
                if error is not None:
                    finished = params.n  # the engine already dropped it
                    if not isinstance(error, InvalidRequestError):  # a 400 is no request
                        timing.abandoned(time.perf_counter(), "error")
                    raise error
        finally:
            if finished < params.n:
                self._loop_thread.abort(request_id)
                timing.abandoned(time.perf_counter(), "abort")
            self._inflight.discard(request_id)
            if not self._inflight:
                self._drained.set()

    async def stats(self, target_worker: str | None = None) -> dict[str, Any]:
        """Fresh engine stats (taken on the loop thread), this worker's identity and its judge
        of the index. A call with ``target_worker`` (a replica id) is refused elsewhere."""
        self._check_target(target_worker)
        stats = await self._on_engine(lambda e: e.stats())
        return {
            **asdict(stats),
            "worker": self.replica_id,
            "pid": os.getpid(),
            "worker_id": self._publisher.worker_id if self._publisher else None,  # in the index
            "epoch": self.epoch,
            "block_size": self.block_size,
            "fingerprint": self.fingerprint,
            "model": self.model_name,
            "publisher": asdict(self._publisher.stats) if self._publisher else None,
            "index_synced": bool(self._publisher and not self._publisher.dirty),
            "index_truth": {"judged": self._truth.judged, "off": dict(self._truth.off)},
            "rss_bytes": placement.rss_bytes(),
            "max_model_len": self.engine.max_model_len,
        }

    async def cached_block_hashes(self, target_worker: str | None = None) -> list[bytes]:
        """Every block hash in this engine's prefix cache (leak checks compare the index)."""
        self._check_target(target_worker)
        return await self._snapshot()

    async def reset_prefix_cache(self, target_worker: str | None = None) -> None:
        self._check_target(target_worker)
        await self._on_engine(lambda e: e.reset_prefix_cache())

    async def load_lora(self, name: str, path: str) -> str:  # its identity, or a 400's error
        return await self._on_engine(lambda e: e.load_lora(name, path))

    async def _on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the loop thread (the only one allowed to touch the engine)."""
        self._require_loop()
        return await asyncio.wrap_future(self._loop_thread.call(fn))

    def _require_loop(self) -> None:
        if not self._loop_thread.is_alive():  # nobody would ever answer: fail now
            raise RuntimeError(f"engine loop is not running: {self._loop_thread.error!r}")

    def _check_target(self, target_worker: str | None) -> None:
        if target_worker is not None and target_worker != self.replica_id:
            raise ValueError(f"call meant for {target_worker} reached {self.replica_id}")

    def load(self) -> WorkerLoad:
        """Engine-reported load from the latest snapshot (any thread)."""
        stats, taken_at = self._loop_thread.snapshot
        return stats.load(taken_at)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's periodic hook: what routers may use when the index has nothing, and the
        LoRA adapters in the batch's slots (router.adapter_slots)."""
        stats, at = self._loop_thread.snapshot
        lora, slots = stats.lora, SlotReport(stats.lora.resident, stats.lora.max_loras,
                                             stats.lora.load_s, at)
        return {"worker": self.replica_id, "block_size": self.block_size,
                "fingerprint": self.fingerprint, "load": asdict(stats.load(at)),
                **(slots.stats() if lora.registered or lora.resident else {})}

    async def check_health(self) -> None:
        """Healthy while the engine loop runs and comes round: a step stuck for
        ``stall_timeout_s`` fails it, so Serve replaces the replica. Never touches Redis."""
        self._require_loop()
        stalled = self._loop_thread.stalled_s()
        if stalled > self._stall_timeout_s:
            raise RuntimeError(
                f"engine loop stuck for {stalled:.1f} s (limit {self._stall_timeout_s:g} s)")

    # ------------------------------------------------------------------------------ index

    def _on_kv_events(self, events: list[KVEvent]) -> None:
        """Engine thread, once per step with events: hand them to the publisher (non-blocking)."""
        self._truth.on_events(events)
        if self._publisher is not None:
            self._publisher.publish(events)

    async def _snapshot(self) -> list[bytes]:
        """Every cached hash, taken on the engine thread (the publisher resyncs from it)."""
        return await self._on_engine(lambda e: e.cached_block_hashes())

    async def _metrics_loop(self, interval_s: float = 1.0) -> None:
        while not self._closed:
            self._metrics.update(self._loop_thread.snapshot[0])
            await asyncio.sleep(interval_s)

    # --------------------------------------------------------------------------- shutdown

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop serving: refuse new requests, let in-flight streams finish for up to
        ``timeout_s`` (default ``drain_timeout_s``), abort the rest, then stop the engine loop
        and background tasks and deregister. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._drain(self._drain_timeout_s if timeout_s is None else timeout_s)
        self._loop_thread.stop()
        for task in self._tasks:
            task.cancel()
        if self._publisher is not None:
            try:
                await asyncio.wait_for(self._publisher.close(deregister=True),
                                       DEREGISTER_TIMEOUT_S)
            except Exception as exc:
                log.warning("deregistration failed (%r); the lease will expire", exc)

    async def _drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for in-flight streams to end; abort the rest (blocks freed
        at once, each stream's last delta says "abort") rather than leave them to be cut off
        when the process goes."""
        if not self._inflight or not self._loop_thread.is_alive():
            return
        log.info("draining %d in-flight requests for up to %g s", len(self._inflight), timeout_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), timeout_s)
            return
        log.warning("aborting %d requests still in flight after %g s", len(self._inflight),
                    timeout_s)
        for request_id in self._inflight:
            self._loop_thread.abort(request_id, notify=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), ABORT_GRACE_S)

    def __del__(self) -> Any:
        """Serve's graceful-shutdown hook: Serve awaits the coroutine returned here. Called by
        the garbage collector instead, it only stops the engine thread (the lease expires)."""
        if getattr(self, "_closed", True) or getattr(self, "_loop_thread", None) is None:
            return None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is getattr(self, "_loop", None):
            return self.shutdown()
        self._closed = True
        self._loop_thread.stop()
        return None


def worker_deployment(
    *,
    num_replicas: int,
    num_cpus: float,
    num_gpus: float,
    max_ongoing_requests: int,
    request_router_config: RequestRouterConfig,
    ray_actor_options: dict[str, Any] | None = None,
    name: str = "LLMWorker",
    health_check_period_s: float = 10.0,
) -> serve.Deployment:
    """``LLMWorker`` as a Serve deployment behind ``request_router_config``. Bind with
    ``.bind(model, engine, redis_url, model_name, ...)``."""
    options = dict(ray_actor_options or {})
    options.setdefault("num_cpus", num_cpus)
    if num_gpus:
        options.setdefault("num_gpus", num_gpus)
    return serve.deployment(
        LLMWorker,
        name=name,
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=options,
        health_check_period_s=health_check_period_s,
        request_router_config=request_router_config,
    )
