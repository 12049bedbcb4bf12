"""`LLMWorker`: the Ray Serve replica that owns one engine (one per GPU, or a CPU share).

Threads. The engine is not thread-safe, so one loop thread (:class:`EngineLoop`) owns it: it
takes add / abort / call commands from a queue, steps the engine while work is pending, and hands
each step's outputs to the waiting ``generate`` streams with ``loop.call_soon_threadsafe``. An
error in one request (bad input) fails that request only; an exception inside a step fails the
requests that step ran (their blocks are freed, the cache entries it was writing are withdrawn
and the index told) and the loop goes on.

Index. When a Redis URL is given the replica registers (Serve replica id, a fresh time-based
epoch, block size, model fingerprint, node) and runs an ``EventPublisher`` that ships the
engine's KV events, keeps the lease with heartbeats carrying the engine-reported load, and
resyncs the full block set after an outage. Redis being down never stops serving, and
``check_health`` never touches it. ``__del__`` (Serve's graceful shutdown hook) stops the loop
and deregisters.

Serve options (replicas, ``num_cpus``/``num_gpus``, the request router) are set by whoever wraps
this class with ``serve.deployment``; :func:`worker_deployment` is the usual way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.util import metrics

from router.events import KVEvent, WorkerLoad
from router.index import PrefixIndex
from router.publisher import EventPublisher
from router.request import GenerateRequest
from workers.checkpoints import resolve_checkpoint
from workers.engine import EngineConfig, EngineStats, LLMEngine, RequestOutput, StepFailedError
from workers.errors import InvalidRequestError
from workers.sampling import SamplingParams, TokenLogprob

log = logging.getLogger("ray.serve")

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
_TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0]
_ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0]


@dataclass
class TokenDelta:
    """New tokens of one sample of one request from one engine step."""

    index: int  # sample index (n > 1)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int
    worker: str  # replica unique id (tests assert routing with it)


def _drain(
    first: list[RequestOutput] | BaseException, pending: asyncio.Queue
) -> tuple[list[list[RequestOutput]], BaseException | None]:
    """``first`` and every step already queued behind it, up to an error (returned apart)."""
    steps: list[list[RequestOutput]] = []
    item = first
    while True:
        if isinstance(item, BaseException):
            return steps, item
        steps.append(item)
        if pending.empty():
            return steps, None
        item = pending.get_nowait()


def merge_steps(steps: list[list[RequestOutput]]) -> list[RequestOutput]:
    """One output per sample for several engine steps, tokens in order.

    When the consumer falls behind (a loaded host), its queued steps go out as one delta: the
    same tokens in fewer stream messages, as vLLM's output collector does, so per-message
    overhead in Serve, the ingress and the client does not grow with the backlog.
    """
    merged: dict[int, RequestOutput] = {}
    for step in steps:
        for out in step:
            prev = merged.get(out.index)
            if prev is None:
                merged[out.index] = replace(out, new_token_ids=list(out.new_token_ids))
                continue
            logprobs = None
            if prev.new_logprobs is not None or out.new_logprobs is not None:
                logprobs = [*(prev.new_logprobs or []), *(out.new_logprobs or [])]
            merged[out.index] = replace(
                out, new_token_ids=[*prev.new_token_ids, *out.new_token_ids],
                new_logprobs=logprobs,
            )
    return list(merged.values())


def sampling_params(sampling: dict[str, Any]) -> SamplingParams:
    """The request's plain dict as validated SamplingParams (InvalidRequestError otherwise)."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise InvalidRequestError(f"unknown sampling parameters: {sorted(unknown)}")
    params = SamplingParams(**sampling)
    params.validate()
    return params


@dataclass
class _Stream:
    """Where the loop thread sends one request's outputs (a list per step, or an exception)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    remaining: int  # samples not finished yet

    def send(self, item: list[RequestOutput] | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop(threading.Thread):
    """The one thread that touches the engine."""

    # Routers read a worker's load every second or two; a snapshot a tenth of a second old is
    # fresh enough, and taking it (the queued backlog walks the waiting prompts' block hashes)
    # stays off most steps.
    def __init__(self, engine: LLMEngine, stats_interval_s: float = 0.1) -> None:
        super().__init__(name="prefixserve-engine", daemon=True)
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._stats_interval_s = stats_interval_s
        self._stats_at = 0.0
        # Latest (stats, wall-clock time taken), replaced whole so other threads read it safely.
        self.snapshot: tuple[EngineStats, float] = (engine.stats(), time.time())
        self.error: BaseException | None = None  # set if the loop itself died

    # Called from other threads -------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            cache_salt: str | None, stream: _Stream) -> None:
        self._commands.put(("add", request_id, prompt, params, cache_salt, stream))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread; await with ``asyncio.wrap_future``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._commands.put(("stop",))
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)

    # The loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.engine.has_unfinished():
                    self._step()
                self._refresh_stats(force=not self.engine.has_unfinished())
        except BaseException as exc:  # a bug in the loop itself: fail loudly, answer everyone
            self.error = exc
            log.exception("engine loop died")
            raise
        finally:
            self._fail_everyone(RuntimeError(f"engine loop stopped: {self.error!r}"))

    def _fail_everyone(self, exc: Exception) -> None:
        """Nobody will serve what is waiting: fail it instead of leaving callers hanging."""
        for stream in self._streams.values():
            stream.send(exc)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[-1].send(exc)
            elif command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(exc)

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, salt, stream = command
            try:
                self.engine.add_request(request_id, prompt, params, salt)
            except Exception as exc:  # InvalidRequestError, or anything the engine rejects
                stream.send(exc)
                return
            self._streams[request_id] = stream
        elif kind == "abort":
            if self._streams.pop(command[1], None) is not None:
                self.engine.abort(command[1])
        elif kind == "call":
            _, fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailedError as exc:
            # The engine dropped the step's requests and published the rollback of the blocks
            # it hashed; fail exactly those streams and keep serving the rest.
            log.exception("engine step failed; failing %d requests", len(exc.request_ids))
            for request_id in exc.request_ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.send(RuntimeError(f"engine step failed: {exc.__cause__!r}"))
            return
        per_request: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            per_request.setdefault(out.request_id, []).append(out)
        for request_id, outs in per_request.items():
            stream = self._streams.get(request_id)
            if stream is None:  # aborted: its caller is gone
                continue
            stream.remaining -= sum(1 for o in outs if o.finished)
            if stream.remaining <= 0:
                del self._streams[request_id]
            stream.send(outs)

    def _refresh_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= self._stats_interval_s:
            self.snapshot = (self.engine.stats(), time.time())
            self._stats_at = now


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (offline use): any unique name will do
        return f"local-{uuid.uuid4().hex[:8]}"


def _node_id() -> str:
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:
        return ""


def _rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _load_engine(
    model: str, config: EngineConfig, on_kv_events: Callable[[list[KVEvent]], None]
) -> LLMEngine:
    """The engine for `model`, resolved on this node (a GGUF converted once per node)."""
    return LLMEngine.from_pretrained(resolve_checkpoint(model), config, on_kv_events)


def _device(requested: str) -> str:
    """``auto``: in a Ray actor, the GPU Ray assigned to it (else CPU); elsewhere any GPU."""
    if requested != "auto":
        return requested
    import torch

    in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if in_actor and not ray.get_gpu_ids():
        return "cpu"  # a GPU visible to a replica that did not ask for one is someone else's
    return "cuda" if torch.cuda.is_available() else "cpu"


class LLMWorker:
    """One engine behind a Serve replica. See the module docstring for the threading model."""

    async def __init__(
        self,
        model: str,
        engine: dict[str, Any] | None = None,
        redis_url: str | None = None,
        model_name: str = "",
        lease_ttl_s: float = 10.0,
        heartbeat_interval_s: float = 1.0,
        index_deadline_s: float = 0.5,
        stream_interval: int = 1,
    ) -> None:
        """
        Args:
            model: what `--model` names (`workers.checkpoints`), resolved on this node.
            engine: ``workers.engine.EngineConfig`` fields; ``device`` defaults to ``auto``
                (the GPU Ray assigned, else CPU).
            redis_url: the prefix index; None serves without publishing.
            model_name: served model name: the index keyspace, shared with the router.
            lease_ttl_s: the worker's lease in the index (renewed every heartbeat).
            heartbeat_interval_s: how often load is reported and the lease renewed.
            index_deadline_s: per-call Redis deadline for this worker's index client (publishing
                is off the request path, so it can be generous; routers use a tight one).
            stream_interval: engine steps per streamed delta after the first token (SGLang's
                ``--stream-interval``): fewer messages through Serve, the ingress and the
                client for the same tokens; the first token always goes out at once.
        """
        if stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.replica_id = _replica_id()
        self.model_name = model_name
        self._stream_interval = stream_interval
        self._ids = itertools.count()
        self._closed = False
        self._publisher: EventPublisher | None = None
        self._tasks: list[asyncio.Task] = []
        self.epoch = time.time_ns() // 1000  # microseconds: a restart always gets a larger one

        config = EngineConfig(**(engine or {}))
        config.device = _device(config.device)
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(
            _load_engine, model, config, self._on_kv_events
        )
        self.block_size = self.engine.block_size
        self.fingerprint = self.engine.model_fingerprint
        self._loop_thread = EngineLoop(self.engine)
        self._loop_thread.start()
        self._init_metrics()
        self._tasks.append(self._loop.create_task(self._metrics_loop()))
        if redis_url:
            index = PrefixIndex(
                redis_url, model_name, deadline_s=index_deadline_s, lease_ttl_s=lease_ttl_s
            )
            self._publisher = EventPublisher(
                index,
                replica_id=self.replica_id,
                epoch=self.epoch,
                block_size=self.block_size,
                fingerprint=self.fingerprint,
                snapshot=self._snapshot,
                load=self.load,
                node=_node_id(),
                heartbeat_interval_s=heartbeat_interval_s,
                # A dead replica's entries go soon after its lease lapses, not 30 s later.
                gc_interval_s=min(30.0, max(1.0, lease_ttl_s)),
            )
            # Registers (retrying while Redis is down), publishes, heartbeats, resyncs.
            self._publisher.start()
        log.info(
            "LLMWorker %s ready: model %r on %s, block_size=%d fingerprint=%s index=%s",
            self.replica_id, model_name, config.device, self.block_size, self.fingerprint,
            "on" if redis_url else "off",
        )

    # ---------------------------------------------------------------------------- serving

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream this request's tokens: per sample, one delta per engine step (the first token
        at once; later ones every ``stream_interval`` steps, and a consumer's backlog as one).

        Raises InvalidRequestError for bad input. If the caller goes away (the generator is
        closed or cancelled), the request is aborted and its blocks are freed.
        """
        params = sampling_params(request.sampling or {})
        self._require_loop()
        request_id = f"{request.request_id}#{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        start = time.perf_counter()
        last: float | None = None
        finished = 0
        self._loop_thread.add(
            request_id, list(request.prompt_token_ids), params, request.cache_salt, stream
        )
        held: list[list[RequestOutput]] = []  # steps not streamed yet (stream_interval > 1)
        try:
            while finished < params.n:
                steps, error = _drain(await stream.queue.get(), stream.queue)
                held += steps
                if (error is None and last is not None and len(held) < self._stream_interval
                        and not any(o.finished for step in held for o in step)):
                    continue
                now = time.perf_counter()
                if any(o.new_token_ids for step in held for o in step):
                    if last is None:
                        self._ttft.observe(now - start)
                    else:
                        self._itl.observe(now - last)
                    last = now
                for out in merge_steps(held):
                    finished += out.finished
                    yield TokenDelta(
                        index=out.index,
                        token_ids=out.new_token_ids,
                        logprobs=out.new_logprobs,
                        finished=out.finished,
                        finish_reason=out.finish_reason,
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_cached_tokens=out.num_cached_tokens,
                        worker=self.replica_id,
                    )
                held = []
                if error is not None:
                    finished = params.n  # the engine already dropped it
                    raise error
        finally:
            if finished < params.n:
                self._loop_thread.abort(request_id)

    async def stats(self, target_worker: str | None = None) -> dict[str, Any]:
        """Fresh engine stats (taken on the loop thread) plus this worker's identity.

        ``target_worker`` (a replica id) makes ``PrefixAwareRequestRouter`` send the call to
        that replica; a replica that receives a call meant for another one refuses it.
        """
        self._check_target(target_worker)
        stats = await self._on_engine(lambda e: e.stats())
        return {
            **asdict(stats),
            "worker": self.replica_id,
            "worker_id": self.worker_id,
            "epoch": self.epoch,
            "block_size": self.block_size,
            "fingerprint": self.fingerprint,
            "model": self.model_name,
            "publisher": asdict(self._publisher.stats) if self._publisher else None,
            "index_synced": bool(self._publisher and not self._publisher.dirty),
            "rss_bytes": _rss_bytes(),
        }

    async def cached_block_hashes(self, target_worker: str | None = None) -> list[bytes]:
        """Every block hash in this engine's prefix cache (leak checks compare the index)."""
        self._check_target(target_worker)
        return await self._snapshot()

    async def reset_prefix_cache(self, target_worker: str | None = None) -> None:
        self._check_target(target_worker)
        await self._on_engine(lambda e: e.reset_prefix_cache())

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
        s, taken_at = self._loop_thread.snapshot
        return WorkerLoad(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            queued_prefill_tokens=s.queued_prefill_tokens,
            kv_usage=s.kv_usage,
            prefill_tokens_per_s=s.prefill_tokens_per_s,
            decode_tokens_per_s=s.decode_tokens_per_s,
            timestamp=taken_at,  # routers count what they sent after this as not yet in it
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's periodic hook: what routers may use when the index has nothing."""
        return {
            "worker": self.replica_id,
            "block_size": self.block_size,
            "fingerprint": self.fingerprint,
            "load": asdict(self.load()),
        }

    async def check_health(self) -> None:
        """Healthy while the engine loop runs. Never depends on Redis."""
        self._require_loop()

    # ------------------------------------------------------------------------------ index

    def _on_kv_events(self, events: list[KVEvent]) -> None:
        """Engine thread, once per step with events: hand them to the publisher (non-blocking)."""
        if self._publisher is not None:
            self._publisher.publish(events)

    async def _snapshot(self) -> list[bytes]:
        """Every cached hash, taken on the engine thread (the publisher resyncs from it)."""
        return await self._on_engine(lambda e: e.cached_block_hashes())

    @property
    def worker_id(self) -> int | None:
        """Small-integer id in the index (None until registered; may change after an outage)."""
        return self._publisher.worker_id if self._publisher is not None else None

    # ---------------------------------------------------------------------------- metrics

    def _init_metrics(self) -> None:
        tags = {"worker": self.replica_id, "model_name": self.model_name}
        keys = ("worker", "model_name")

        def tagged(metric: Any) -> Any:
            return metric.set_default_tags(tags)

        self._queries = tagged(metrics.Counter(
            "prefixserve_prefix_cache_queries",
            description="Prompt tokens looked up in the prefix cache (vLLM prefix_cache_queries).",
            tag_keys=keys))
        self._hits = tagged(metrics.Counter(
            "prefixserve_prefix_cache_hits",
            description="Prompt tokens served from the prefix cache (vLLM prefix_cache_hits).",
            tag_keys=keys))
        self._kv_usage = tagged(metrics.Gauge(
            "prefixserve_kv_cache_usage_perc", description="KV cache blocks in use (0-1).",
            tag_keys=keys))
        self._running = tagged(metrics.Gauge(
            "prefixserve_num_requests_running", description="Sequences in the running batch.",
            tag_keys=keys))
        self._waiting = tagged(metrics.Gauge(
            "prefixserve_num_requests_waiting", description="Sequences waiting to be scheduled.",
            tag_keys=keys))
        self._ttft = tagged(metrics.Histogram(
            "prefixserve_time_to_first_token_seconds",
            description="Time from arrival at the worker to the first generated token.",
            boundaries=_TTFT_BUCKETS, tag_keys=keys))
        self._itl = tagged(metrics.Histogram(
            "prefixserve_inter_token_latency_seconds",
            description="Time between consecutive token deltas of one request.",
            boundaries=_ITL_BUCKETS, tag_keys=keys))

    async def _metrics_loop(self, interval_s: float = 1.0) -> None:
        queried = hit = 0
        while not self._closed:
            s = self._loop_thread.snapshot[0]
            if s.prompt_tokens_queried > queried:
                self._queries.inc(s.prompt_tokens_queried - queried)
            if s.prompt_tokens_hit > hit:
                self._hits.inc(s.prompt_tokens_hit - hit)
            queried, hit = s.prompt_tokens_queried, s.prompt_tokens_hit
            self._kv_usage.set(s.kv_usage)
            self._running.set(s.num_running)
            self._waiting.set(s.num_waiting)
            await asyncio.sleep(interval_s)

    # --------------------------------------------------------------------------- shutdown

    async def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop serving: stop the engine loop and background tasks, deregister. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop_thread.stop()
        for task in self._tasks:
            task.cancel()
        if self._publisher is not None:
            try:
                await asyncio.wait_for(self._publisher.close(deregister=True), timeout_s)
            except Exception as exc:
                log.warning("deregistration failed (%r); the lease will expire", exc)

    def __del__(self) -> Any:
        """Serve's graceful-shutdown hook: Serve awaits the coroutine returned here.

        Called by the garbage collector instead (no running loop of ours), it only stops the
        engine thread; the index entries go when the lease expires.
        """
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
    num_replicas: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    max_ongoing_requests: int = 256,
    router_kwargs: dict[str, Any] | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    name: str = "LLMWorker",
    health_check_period_s: float = 10.0,
    routing_stats_period_s: float = 2.0,
    prefix_routing: bool = True,
) -> serve.Deployment:
    """``LLMWorker`` as a Serve deployment routed by ``PrefixAwareRequestRouter``.

    ``router_kwargs`` go to ``PrefixAwareRequestRouter.initialize_state`` (redis_url, model,
    block_size, fingerprint, ...). With ``prefix_routing=False`` Serve's default power-of-two
    router is used instead (the baseline). Bind with ``.bind(model, engine, redis_url,
    model_name, ...)``.
    """
    options = dict(ray_actor_options or {})
    options.setdefault("num_cpus", num_cpus)
    if num_gpus:
        options.setdefault("num_gpus", num_gpus)
    router_config = RequestRouterConfig(
        request_routing_stats_period_s=routing_stats_period_s,
        **(
            {
                "request_router_class": "router.request_router:PrefixAwareRequestRouter",
                "request_router_kwargs": dict(router_kwargs or {}),
            }
            if prefix_routing
            else {}
        ),
    )
    return serve.deployment(
        LLMWorker,
        name=name,
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=options,
        request_router_config=router_config,
        health_check_period_s=health_check_period_s,
    )
