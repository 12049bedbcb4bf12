"""A router's own copy of the prefix index, kept by following the index's event log
(``IndexSettings.event_log``): a decision's lookup answered in process, without a round trip.
The index keeps the log while routers ask for it (:meth:`EventLog.keep_log`), so workers need
no setting of their own.

A follower starts from the index's blocks as they are (:meth:`EventLog.scan_holders`, read while
events flow) and then applies the log's entries from the newest one it saw before that read:
every entry states a (block, worker) pair's presence outright, or a worker's whole set, so an
entry the read already reflects changes nothing when applied again, and the log's order settles
every pair an entry touched. Each entry carries a number without gaps; a jump means the log's
cap trimmed entries this follower had not read, and it starts over. The live workers (a lapsed
lease drops out within ``live_every_s``) and their loads are read in the background.

While the follower is not caught up (starting, starting over, the index unreachable) it is
not :attr:`IndexFollower.ready` and the router asks the index as it does without a log. A
sharded index has a log per worker group: one cursor each, worker ids offset by group.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prefixserve.router.blocks import DIGEST_BYTES, Chain
from prefixserve.router.events import MEDIA, BlockStored, WorkerLoad, decode_events
from prefixserve.router.index import EventLog, LogEntry, LookupResult, Matches, PrefixIndex
from prefixserve.router.local_index import KEY, LocalIndex, PredictedBlocks
from prefixserve.router.redis_records import split_code
from prefixserve.router.sharded_index import GROUP_SPAN, ShardedPrefixIndex

# Not Serve's logger: its records read Ray's runtime context, and a router's follower may
# outlive Ray in its process (a handle kept past serve.shutdown()).
logger = logging.getLogger(__name__)

READ_ENTRIES = 1024  # the most log entries one read returns
WAIT_S = 0.2  # a read waits this long for news before it asks again
MAX_RETRY_S = 30.0  # retries after a failure back off up to this


def _stopping() -> bool:
    """Whether this task was asked to stop, though the CancelledError did not reach us: a client
    library may turn it into its own error (redis-py's connect does), which must not keep a
    loop that retries errors alive. (``Task.cancelling`` is 3.11+; before, no such check.)"""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


def event_logs(index: PrefixIndex) -> list[EventLog] | None:
    """The logs to follow for ``index`` (one per worker group), or None when its store keeps
    none that a router can read."""
    stores = index.stores if isinstance(index, ShardedPrefixIndex) else [index]
    logs = [s for s in stores if isinstance(s, EventLog)]
    return logs if len(logs) == len(stores) else None


def logged_at(entry_id: bytes) -> float:
    """When a stream entry was logged (epoch seconds): Redis names it ``<ms>-<seq>``."""
    return int(entry_id.partition(b"-")[0]) / 1000


@dataclass
class _Cursor:
    """Where one log's follower stands."""

    after: bytes = b"0-0"  # the last entry applied (or the newest before the starting read)
    number: int = 0  # the number of the last entry logged by then: the next one is one more
    ready: bool = False  # started and not behind


class IndexFollower:
    """The confirmed holders, the predicted entries, the live workers and their loads of one
    model's index, as its event logs and background reads report them."""

    def __init__(
        self,
        index: PrefixIndex,
        logs: list[EventLog],
        *,
        log_entries: int,
        loads_every_s: float = 0.05,
        live_every_s: float = 1.0,
        retry_s: float = 1.0,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        """``on_lag(seconds)``: per read, how long its oldest entry waited in the log (the
        store's clock when it was logged to this host's when it was applied)."""
        self._index, self._logs, self._log_entries = index, logs, log_entries
        self._on_lag = on_lag
        self._cursors = [_Cursor() for _ in logs]
        self._loads_every_s, self._live_every_s, self._retry_s = (
            loads_every_s, live_every_s, retry_s)
        self._held = LocalIndex()
        self._predicted = PredictedBlocks()
        self._names: dict[int, str] = {}  # live worker id -> replica id
        self._ids: Mapping[str, int] = {}  # replica id -> live worker id
        self._loads: Mapping[str, WorkerLoad] = {}  # replica id -> its latest load
        self._live_at = -math.inf  # when the live workers were last read (monotonic)

    @property
    def held(self) -> LocalIndex:
        """The confirmed holders as followed so far (read only)."""
        return self._held

    @property
    def ready(self) -> bool:
        """Whether lookups may be answered here: every log followed, the live workers fresh."""
        fresh = time.monotonic() - self._live_at <= 3 * self._live_every_s
        return fresh and all(c.ready for c in self._cursors)

    def lookup(self, chain: Chain) -> LookupResult:
        """What :meth:`PrefixIndex.lookup` answers, from this copy: each live worker's
        confirmed depth and, with the predicted entries, its predicted depth."""
        confirmed = self._held.depths(chain)
        predicted = self._predicted.depths(chain, confirmed, time.monotonic())
        lower = self._held.lower_blocks(chain, confirmed)
        names = self._names
        if names.keys() >= confirmed.keys():  # all live (C-level passes, not one per worker)
            ids, depths = list(confirmed), list(confirmed.values())
        else:
            ids = [w for w in confirmed if w in names]
            depths = [confirmed[w] for w in ids]
        ahead = depths  # one list while nothing is predicted (read only)
        if predicted:
            ahead = [max(confirmed[w], predicted.get(w, 0)) for w in ids]
            for worker_id, depth in predicted.items():
                if worker_id not in confirmed and worker_id in names:
                    ids.append(worker_id)
                    depths.append(0)
                    ahead.append(depth)
        matches = Matches(list(map(names.__getitem__, ids)), ids, depths, ahead, self._loads,
                          {names[w]: v for w, v in lower.items() if w in names})
        walked = max(ahead, default=min(1, len(chain)))
        return LookupResult(matches, walked, self._loads, self._ids)

    # -- following ------------------------------------------------------------------------

    async def run(self) -> None:
        """Follow every log and keep the live workers and loads fresh, until cancelled."""
        await asyncio.gather(self._keep_fresh(), *(self._follow(g) for g in range(len(self._logs))))

    async def catch_up(self) -> None:
        """Start where needed, read every log to its end and refresh the live workers and
        loads, now (the simulator's way to follow between its steps)."""
        for group, cursor in enumerate(self._cursors):
            while True:
                if not cursor.ready:
                    await self._start(group)
                if await self._read(group, 0.0) < READ_ENTRIES and cursor.ready:
                    break
        await self._refresh_live()
        await self._refresh_loads()

    async def _follow(self, group: int) -> None:
        """Start, read, and after a failure start over, backing off (logged once a pause)."""
        cursor, pause = self._cursors[group], self._retry_s
        while True:
            try:
                if not cursor.ready:
                    await self._start(group)
                    if pause > self._retry_s:
                        logger.info("prefix index log %d: following again", group)
                    pause = self._retry_s
                await self._read(group, WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the index is down, or wrote junk: start over later
                if _stopping():
                    raise asyncio.CancelledError from exc
                cursor.ready = False
                if pause == self._retry_s:
                    logger.warning("prefix index log %d: following paused, lookups go to the "
                                   "index meanwhile (%r)", group, exc)
                await asyncio.sleep(pause)
                pause = min(2 * pause, MAX_RETRY_S)

    async def _start(self, group: int) -> None:
        """This group's blocks as the index holds them now; the log from before the read."""
        cursor, log = self._cursors[group], self._logs[group]
        cursor.ready = False
        await log.keep_log(self._log_entries)  # again after Redis restarted empty
        after, number = await log.log_head()
        held: dict[int, list[bytes]] = {}
        lower: dict[tuple[int, int], list[bytes]] = {}  # (worker, tier) -> keys held there
        offset = group * GROUP_SPAN
        async for key, ids in log.scan_holders():
            if len(ids) % 2:  # junk, not 2-byte codes (the index skips it too)
                continue
            for k in range(0, len(ids), 2):
                worker_id, tier = split_code(int.from_bytes(ids[k : k + 2], "big"))
                worker_id += offset
                held.setdefault(worker_id, []).append(key)
                if tier:
                    lower.setdefault((worker_id, tier), []).append(key)
        for worker_id in [w for w in self._held.workers() if w // GROUP_SPAN == group]:
            if worker_id not in held:
                self._held.drop(worker_id)
        for worker_id, keys in held.items():
            self._held.replace(worker_id, keys)
        for (worker_id, tier), keys in lower.items():
            self._held.apply(worker_id, [BlockStored(tuple(keys), MEDIA[tier])])
        cursor.after, cursor.number, cursor.ready = after, number, True

    async def _read(self, group: int, wait_s: float) -> int:
        """Apply the next entries of the group's log; returns how many it read. A gap in the
        numbers leaves the cursor not ready (to start over)."""
        cursor = self._cursors[group]
        entries = await self._logs[group].read_log(cursor.after, count=READ_ENTRIES,
                                                   wait_s=wait_s)
        for entry in entries:
            if entry.number != cursor.number + 1:
                logger.info("prefix index log %d: entries %d-%d trimmed before read; starting "
                            "over", group, cursor.number + 1, entry.number - 1)
                cursor.ready = False
                break
            self._take(group * GROUP_SPAN + entry.worker_id, entry)
            cursor.after, cursor.number = entry.entry_id, entry.number
        if entries and self._on_lag is not None:
            self._on_lag(max(0.0, time.time() - logged_at(entries[0].entry_id)))
        return len(entries)

    def _take(self, worker_id: int, entry: LogEntry) -> None:
        data = entry.data
        if entry.kind == b"O":
            self._held.apply(worker_id, decode_events(data))
        elif entry.kind == b"Z":
            self._held.replace(worker_id, [data[k : k + KEY] for k in range(0, len(data), KEY)])
        elif entry.kind == b"D":
            self._held.drop(worker_id)
        elif entry.kind == b"P":
            until = time.monotonic() + int.from_bytes(data[:4], "big") / 1000
            blocks = [data[k : k + DIGEST_BYTES] for k in range(4, len(data), DIGEST_BYTES)]
            self._predicted.add(worker_id, blocks, until)

    async def _keep_fresh(self) -> None:
        next_live = 0.0
        while True:
            try:
                if time.monotonic() >= next_live:
                    await self._refresh_live()
                    next_live = time.monotonic() + self._live_every_s
                await self._refresh_loads()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the index is down: ready lapses with the live list
                if _stopping():
                    raise asyncio.CancelledError from exc
                logger.debug("prefix index: live workers or loads not read (%r)", exc)
            await asyncio.sleep(self._loads_every_s)

    async def _refresh_live(self) -> None:
        workers = await self._index.live_workers()
        self._names = {w.worker_id: w.replica_id for w in workers}
        self._ids = {w.replica_id: w.worker_id for w in workers}
        self._live_at = time.monotonic()

    async def _refresh_loads(self) -> None:
        """The loads changed since the last read: a lookup of no block carries them."""
        self._loads = (await self._index.lookup(Chain())).loads
