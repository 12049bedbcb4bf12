"""A worker's side of the prefix index: publish KV events without ever blocking the engine.

::

    publisher = EventPublisher(
        index, replica_id=rid, epoch=time.time_ns() // 1000, block_size=16, fingerprint=fp,
        snapshot=ask_engine_thread_for_cached_block_hashes,   # sync or async callable
        load=current_worker_load,                             # sync or async, -> WorkerLoad
    )
    task = publisher.start()            # or asyncio.create_task(publisher.run())
    engine = LLMEngine.from_pretrained(path, on_kv_events=publisher.publish)
    ...
    await publisher.close()             # stops run() and deregisters

``publish(events)`` is called from the engine thread once per step: it only appends to a
locked buffer and wakes the loop. ``run()`` (a task on the replica's event loop) registers the
worker, turns the buffer into sequenced :class:`EventBatch` es, applies them, renews the lease
with the load every ``heartbeat_interval_s`` and runs the index GC now and then.

The worker is the source of truth for its blocks. Whenever the index may have lost events (an
apply failed or timed out, Redis went away, the index asked for a resync after a sequence gap,
or the registration vanished because Redis restarted empty) the publisher is *dirty*: it drops
buffered events, and as soon as Redis answers again it re-registers if needed and replaces its
whole block set from ``snapshot()``. Replaying events that the snapshot already reflects is
harmless (each event sets block membership, last write wins), so no event is ever lost.
Redis trouble never raises out of ``run()``; it is retried with capped exponential backoff,
and logged as a warning when it starts and once a minute while it lasts (with Redis' reason: a
wrong password in a deployed config shows up in the worker logs, not only as load-only routing).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from prefixserve.router.events import EventBatch, KVEvent, WorkerLoad
from prefixserve.router.index import (
    IndexUnavailable,
    PrefixIndex,
    ResultCode,
    StaleEpoch,
    UnknownWorker,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

SnapshotFn = Callable[[], Iterable[bytes] | Awaitable[Iterable[bytes]]]
LoadFn = Callable[[], WorkerLoad | Awaitable[WorkerLoad]]

MAX_BATCH_BLOCKS = 2048  # keeps one apply well inside the index deadline
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_WARN_EVERY_S = 60.0


async def _maybe_await(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        return await value
    return value


def batch_length(events: Sequence[KVEvent], start: int = 0) -> int:
    """How many events from ``start`` make the next batch: as many as fit in
    :data:`MAX_BATCH_BLOCKS` digests, at least one (an event is never cut)."""
    take, blocks = 0, 0
    for event in itertools.islice(events, start, None):
        size = len(getattr(event, "hashes", ()))
        if take and blocks + size > MAX_BATCH_BLOCKS:
            break
        take += 1
        blocks += size
    return take


@dataclass
class PublisherStats:
    batches: int = 0
    events: int = 0
    resyncs: int = 0
    registrations: int = 0
    failures: int = 0
    dropped_events: int = 0


class EventPublisher:
    """Publishes one worker's KV events and load to the index; see the module docstring."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        replica_id: str,
        epoch: int,
        block_size: int,
        fingerprint: str,
        snapshot: SnapshotFn,
        load: LoadFn | None = None,
        node: str = "",
        heartbeat_interval_s: float | None = None,
        gc_interval_s: float = 30.0,
        max_pending_events: int = 100_000,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.index = index
        self.replica_id = replica_id
        self.epoch = epoch
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.node = node
        self._snapshot = snapshot
        self._load = load
        self.heartbeat_interval_s = (
            heartbeat_interval_s if heartbeat_interval_s is not None
            else index.lease_ttl_s / 3
        )
        self.gc_interval_s = gc_interval_s
        self.max_pending_events = max_pending_events
        self.stats = PublisherStats()
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = []
        self._pending_at: list[float] = []  # per pending event, when it was published
        self._on_lag = on_lag  # seconds from a batch's oldest event's step to its apply
        self._dirty = True  # nothing is known to be in the index until the first resync
        self._worker_id: int | None = None
        self._seq = 0
        self._busy = False
        self._closed = False
        self._fenced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._down_since: float | None = None  # monotonic time of the first failed call
        self._next_warning = 0.0

    # -- engine thread ---------------------------------------------------------------------

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one engine step's events. Thread-safe, never blocks on Redis."""
        if not events:
            return
        with self._lock:
            if self._dirty or self._closed or self._fenced:
                self.stats.dropped_events += len(events)  # the next resync covers them
                return
            self._pending.extend(events)
            self._pending_at.extend([time.monotonic()] * len(events))
            if len(self._pending) > self.max_pending_events:
                self.stats.dropped_events += len(self._pending)
                self._clear_pending()
                self._dirty = True
        self._notify()

    def _notify(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the replica is going away
            loop.call_soon_threadsafe(wake.set)

    # -- state -----------------------------------------------------------------------------

    @property
    def worker_id(self) -> int | None:
        return self._worker_id

    @property
    def registered(self) -> bool:
        return self._worker_id is not None

    @property
    def dirty(self) -> bool:
        return self._dirty

    @property
    def fenced(self) -> bool:
        """True once a newer incarnation of this replica took over: publishing stopped."""
        return self._fenced

    def _mark_dirty(self) -> None:
        with self._lock:
            self.stats.dropped_events += len(self._pending)
            self._clear_pending()
            self._dirty = True

    def _clear_pending(self) -> None:
        self._pending.clear()
        self._pending_at.clear()

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until registered, not dirty and every queued event is applied."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.registered and not self._dirty and not self._pending and not self._busy:
                return True
            await asyncio.sleep(0.01)
        return False

    def _note_down(self, exc: Exception) -> None:
        """Warn when the index stops answering, then once a minute while it stays down."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        if now >= self._next_warning:
            self._next_warning = now + _WARN_EVERY_S
            log.warning("prefix index unavailable for %.0f s, %s keeps retrying: %s",
                        now - self._down_since, self.replica_id, exc)

    def _note_up(self) -> None:
        if self._down_since is not None:
            log.info("prefix index available again after %.1f s (%s)",
                        time.monotonic() - self._down_since, self.replica_id)
            self._down_since = None
            self._next_warning = 0.0

    # -- event loop ------------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Run :meth:`run` as a task on the current loop (kept so :meth:`close` can await it)."""
        self._task = asyncio.get_running_loop().create_task(self.run())
        return self._task

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        backoff = _BACKOFF_MIN_S
        next_heartbeat = 0.0
        next_gc = time.monotonic() + self.gc_interval_s
        while not self._closed and not self._fenced:
            self._wake.clear()
            try:
                if self._worker_id is None:
                    await self._register()
                    next_heartbeat = time.monotonic() + self.heartbeat_interval_s
                if self._dirty:
                    await self._resync()
                if time.monotonic() >= next_heartbeat:
                    await self._heartbeat()
                    next_heartbeat = time.monotonic() + self.heartbeat_interval_s
                if self._worker_id is not None and not self._dirty:
                    await self._flush()
                if time.monotonic() >= next_gc:
                    next_gc = time.monotonic() + self.gc_interval_s
                    await self.index.gc()
                backoff = _BACKOFF_MIN_S
                self._note_up()
            except (IndexUnavailable, UnknownWorker) as exc:
                self.stats.failures += 1
                if isinstance(exc, UnknownWorker):
                    self._worker_id = None
                else:
                    self._note_down(exc)
                log.debug("index unavailable (%s); retrying in %.2fs", exc, backoff)
                await self._sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            except StaleEpoch as exc:
                if self._worker_id is None:  # register() said so: keyed by our replica id
                    log.warning("replica %s superseded, stop publishing: %s",
                                self.replica_id, exc)
                    self._fenced = True
                    break
                # The record under our worker id is newer than us. Either a newer incarnation
                # of this replica took over, or Redis restarted empty and another replica got
                # our old id. Only register() can tell: it answers by replica id.
                log.info("worker id %s of %s is taken by a newer epoch (%s); registering again",
                         self._worker_id, self.replica_id, exc)
                self.stats.failures += 1
                self._worker_id = None
                self._mark_dirty()
                continue
            except Exception:  # a failing snapshot/load callable must not kill publishing
                self.stats.failures += 1
                log.exception("event publisher step failed")
                await self._sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            if not self._pending and not self._dirty and self._worker_id is not None:
                await self._sleep(max(0.0, next_heartbeat - time.monotonic()))

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake early when events arrive or close() is called."""
        assert self._wake is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _register(self) -> None:
        worker_id = await self.index.register(
            self.replica_id, epoch=self.epoch, block_size=self.block_size,
            fingerprint=self.fingerprint, node=self.node,
        )
        self._mark_dirty()
        self._worker_id = worker_id
        self._seq = 0
        self.stats.registrations += 1

    async def _resync(self) -> None:
        assert self._worker_id is not None
        with self._lock:  # events after this point are queued again and replayed after
            self._clear_pending()
            self._dirty = False
        self._busy = True
        try:
            hashes = list(await _maybe_await(self._snapshot()))
            await self.index.resync(self._worker_id, self.epoch, hashes, self._seq)
            self.stats.resyncs += 1
        except BaseException:
            self._mark_dirty()
            raise
        finally:
            self._busy = False

    async def _heartbeat(self) -> None:
        assert self._worker_id is not None
        load = await _maybe_await(self._load()) if self._load else WorkerLoad()
        if load.timestamp == 0.0:
            load = replace(load, timestamp=time.time())
        if not await self.index.heartbeat(self._worker_id, self.epoch, load):
            log.info("registration of %s vanished; registering again", self.replica_id)
            self._worker_id = None
            self._mark_dirty()

    async def _flush(self) -> None:
        assert self._worker_id is not None
        while self._pending and not self._dirty:
            with self._lock:
                take = batch_length(self._pending)
                events = tuple(self._pending[:take])
                published = self._pending_at[0] if take else 0.0
                del self._pending[:take], self._pending_at[:take]
            if not events:
                return
            batch = EventBatch(self._worker_id, self.epoch, self._seq + 1, events)
            self._busy = True
            try:
                result = await self.index.apply(batch)
            except BaseException:
                self._mark_dirty()
                raise
            finally:
                self._busy = False
            self._seq += 1
            if result is ResultCode.OK:
                self.stats.batches += 1
                self.stats.events += len(events)
                if self._on_lag is not None:
                    self._on_lag(time.monotonic() - published)
            elif result is ResultCode.STALE_EPOCH:
                raise StaleEpoch(f"apply of {self.replica_id} fenced by a newer epoch")
            else:
                self._mark_dirty()

    async def close(self, deregister: bool = True) -> None:
        """Stop publishing; with ``deregister`` remove this worker's entries from the index."""
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, self.index.admin_deadline_s + 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        if deregister and self._worker_id is not None and not self._fenced:
            try:
                await self.index.deregister(self._worker_id)
            except IndexUnavailable as exc:
                log.info("deregister failed (%s); the lease will expire", exc)
