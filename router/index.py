"""The global prefix index as the router and the publisher see it: which live worker holds which
prefix blocks.

Workers feed it with their own KV events (:meth:`PrefixIndex.apply`, atomic per batch) and keep
a lease alive with their load (:meth:`PrefixIndex.heartbeat`); routers ask
:meth:`PrefixIndex.lookup` for every live worker's matched depth of a chain in one round trip.
The index is advisory: every call has a deadline and raises :class:`IndexUnavailable` fast when
the store is slow, down or refusing, so the caller can route on load alone and keep serving.

:class:`PrefixIndex` is the protocol both depend on; :func:`router.index_stores.open_index`
picks the store by the URL's scheme. The Redis store is :mod:`router.redis_index`.
:class:`IndexSettings` is the index section of the cluster config.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from prefixserve.router.events import EventBatch, WorkerLoad

REDIS_URL_ENV = "PREFIXSERVE_REDIS_URL"  # where routers and workers find the index by default
# A block's key in the index: its digest's first 8 bytes (64 bits name 20M blocks with a
# collision chance near 1e-5, and a collision only misroutes; lua/_key.lua).
INDEX_KEY_BYTES = 8

class IndexSettings(BaseModel):
    """The index section of the cluster config: what every client of one index agrees on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lease_ttl_s: float = Field(10.0, gt=0.0, description="Worker lease in the index")
    predict_ttl_s: float = Field(
        2.0, gt=0.0, description="Lifetime of routing-time predicted index entries")
    predict_exact_blocks: int = Field(
        64, ge=1, description="Blocks past the worker's confirmed depth that a prediction "
        "writes as one index key each (exact depths); the rest of a longer prompt is one "
        "sampled record, so a 128k-token prompt writes 64 keys, not 8,000")
    publish_deadline_s: float = Field(
        0.5, gt=0.0, description="Deadline of a worker's index calls (events, heartbeats): off "
        "the request path, so it can be generous; routers use lookup_deadline_s")
    admin_deadline_s: float = Field(
        1.0, gt=0.0, description="Deadline of maintenance calls (register, resync, GC)")
    shards: int = Field(
        1, ge=1, le=256, description="Worker groups the model's index is split over, each "
        "under its own key prefix (one Redis Cluster slot each): workers write to their "
        "group's, lookups ask all at once. More than 1 when one Redis core cannot keep up "
        "with the fleet's KV events (about 400k block events/s)")
    shard_backoff_s: float = Field(
        1.0, gt=0.0, description="With shards > 1: after a shard fails a lookup (down, or "
        "slower than the deadline), later lookups leave its part unknown this long without "
        "asking it, and answer from the other shards")
    event_log: int = Field(
        20_000, ge=0, description="Routers follow the index's event log, which the index then "
        "keeps about this long (KV event batches, resyncs, predicted entries), and keep their "
        "own copy of the index: a decision's lookup is answered in process, without a round "
        "trip (router.index_follower). A router's copy costs about 20 bytes per (block, "
        "worker) entry (packed arrays; ~0.5 GB at 1,000 workers); 0: no copy, every "
        "decision asks the index")
    connect_timeout_s: float = Field(
        2.0, gt=0.0, description="Time to set up a connection to the index (TCP, TLS, AUTH), "
        "kept out of the call deadlines so that a TLS Redis a few ms away still serves 20 ms "
        "lookups")


class IndexUnavailable(Exception):
    """The store is slow (deadline passed), down or refusing. Raised fast; callers fail open."""


class StaleEpoch(Exception):
    """A newer incarnation of this replica is registered: this one must stop publishing."""


class UnknownWorker(LookupError):
    """The worker id is not registered (for this epoch): register again, then resync."""


class ResultCode(enum.IntEnum):
    """What an index operation did. The Redis scripts return these numbers (``lua/_codes.lua``)."""

    OK = 0
    STALE_EPOCH = 1  # a newer epoch of the worker is registered
    RESYNC_NEEDED = 2  # the batch cannot be applied on top of what the index holds
    UNKNOWN_WORKER = 3  # not registered (for this epoch)
    TAG_TAKEN = 4  # the model's keyspace belongs to another model
    IDS_EXHAUSTED = 5  # every worker id of the model is in use


_FAILURES: dict[ResultCode, tuple[type[Exception], str]] = {
    ResultCode.STALE_EPOCH: (StaleEpoch, "a newer epoch is registered"),
    ResultCode.UNKNOWN_WORKER: (UnknownWorker, "not registered (for this epoch)"),
    ResultCode.TAG_TAKEN: (ValueError, "the model's hash tag belongs to another model"),
    ResultCode.IDS_EXHAUSTED: (RuntimeError, "all 16,383 worker ids of this model are in use"),
}


def expect(raw: int, what: str, *outcomes: ResultCode) -> ResultCode:
    """Decode a store's result code: the code when it is one of ``outcomes`` (OK when none are
    given), else the exception it stands for, with ``what`` saying which call failed."""
    try:
        code = ResultCode(raw)
    except ValueError:
        raise RuntimeError(f"{what}: unknown result code {raw!r}") from None
    if code in (outcomes or (ResultCode.OK,)):
        return code
    error, reason = _FAILURES.get(code, (RuntimeError, f"unexpected {code.name}"))
    raise error(f"{what}: {reason}")


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: int
    replica_id: str
    epoch: int
    block_size: int
    fingerprint: str
    node: str


@dataclass(slots=True)  # one per holder per lookup: not frozen, which costs 2.5x to make
class WorkerMatch:
    worker_id: int
    replica_id: str
    confirmed_depth: int  # consecutive blocks from block 0 confirmed by KV events
    predicted_depth: int  # consecutive blocks confirmed OR predicted (>= confirmed_depth)
    load: WorkerLoad | None
    # of the confirmed blocks, those held below the pool: (host, disk). Host blocks are those
    # past the pool's consecutive depth up to where the first disk block is, disk ones the rest
    # (a worker evicts a chain's tail first: the pool holds its head, the lower tiers its tail)
    lower_blocks: tuple[int, int] = (0, 0)


class Matches(Mapping[str, WorkerMatch]):
    """A lookup's matched workers by replica id, held as columns (one entry per worker, in one
    order; ``lower``: by replica id, where a worker holds blocks below its pool; ``loads``: where
    their loads are, the lookup's map): at 1,000 holders, a record per worker cost more to make
    and read than ranking them does. Reading an entry makes its :class:`WorkerMatch`."""

    __slots__ = ("_at", "confirmed", "ids", "loads", "lower", "names", "predicted")

    def __init__(self, names: list[str], ids: list[int], confirmed: list[int],
                 predicted: list[int], loads: Mapping[str, WorkerLoad | None],
                 lower: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.names, self.ids, self.confirmed, self.predicted = names, ids, confirmed, predicted
        self.loads, self.lower = loads, lower or {}
        self._at: dict[str, int] | None = None

    @classmethod
    def of(cls, matches: Iterable[WorkerMatch]) -> Matches:
        ms = list(matches)
        return cls([m.replica_id for m in ms], [m.worker_id for m in ms],
                   [m.confirmed_depth for m in ms], [m.predicted_depth for m in ms],
                   {m.replica_id: m.load for m in ms},
                   {m.replica_id: m.lower_blocks for m in ms if m.lower_blocks != (0, 0)})

    def __getitem__(self, key: str) -> WorkerMatch:
        if self._at is None:
            self._at = {name: i for i, name in enumerate(self.names)}
        i = self._at[key]
        return WorkerMatch(self.ids[i], key, self.confirmed[i], self.predicted[i],
                           self.loads.get(key), self.lower.get(key, (0, 0)))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def deepest(self) -> int:
        """The deepest match (blocks, confirmed or predicted) of any worker."""
        return max(max(self.confirmed, default=0), max(self.predicted, default=0))


@dataclass(frozen=True)
class LookupResult:
    # keyed by replica_id: the live workers holding block 0 (confirmed or predicted), so a
    # lookup costs what the chain's holders cost, not what the fleet does (a dict of
    # WorkerMatch is taken as their columns)
    matches: Matches
    blocks_walked: int = 0  # how far the walk went before it stopped early
    # every live worker known, matched or not (shared: do not mutate)
    loads: Mapping[str, WorkerLoad] = field(default_factory=dict)  # replica_id -> latest load
    worker_ids: Mapping[str, int] = field(default_factory=dict)  # replica_id -> worker id
    # a sharded index's partial answer: the live workers (as last known) whose shard did not
    # answer, so that matching nothing says nothing about them, and how many shards that was
    unknown: frozenset[str] = frozenset()
    unknown_shards: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.matches, Matches):
            object.__setattr__(self, "matches", Matches.of(self.matches.values()))


@dataclass(frozen=True)
class IndexSize:
    """How much a model's index holds: its (block, worker) entries, its distinct blocks (a
    block held by several workers counts once per group), and the bytes of the workers'
    reverse indexes, which GC walks."""

    entries: int
    blocks: int
    reverse_index_bytes: int

    def __add__(self, other: IndexSize) -> IndexSize:
        return IndexSize(self.entries + other.entries, self.blocks + other.blocks,
                         self.reverse_index_bytes + other.reverse_index_bytes)


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One entry of a store's event log (``IndexSettings.event_log``)."""

    entry_id: bytes  # the store's id of the entry: read on after it
    number: int  # from 1, without a gap: a jump means the log was trimmed past the reader
    worker_id: int  # in the store (a group's own id under sharding)
    kind: bytes  # O: a batch's op stream, Z: a resync's whole set, D: dead, P: predicted
    data: bytes


@runtime_checkable
class EventLog(Protocol):
    """A store whose event log a router can follow (:mod:`router.index_follower`)."""

    async def keep_log(self, entries: int) -> None:
        """Have the store keep its event log, about ``entries`` long, from now on."""
        ...

    async def log_head(self) -> tuple[bytes, int]:
        """The newest entry's id (``b"0-0"`` when the log is empty) and the number of the newest
        entry ever logged (0 for none): the next entry must carry the number after it."""
        ...

    async def read_log(self, after: bytes, *, count: int, wait_s: float) -> list[LogEntry]:
        """Entries past ``after``, oldest first, waiting up to ``wait_s`` for one."""
        ...

    def scan_holders(self) -> AsyncIterator[tuple[bytes, bytes]]:
        """Every block's key and its holders' 2-byte ids."""
        ...


class PrefixIndex(Protocol):
    """One model's prefix index. An implementation is safe to share between the tasks of one
    event loop; every method raises :class:`IndexUnavailable` when the store does not answer
    in time."""

    lease_ttl_s: float  # a worker's lease; the publisher heartbeats three times per lease
    admin_deadline_s: float  # deadline of the chunked maintenance calls (resync, GC)

    async def register(
        self, replica_id: str, *, epoch: int, block_size: int, fingerprint: str, node: str = ""
    ) -> int:
        """Register (or re-register) a replica; returns its small-integer worker id.

        The same replica_id and epoch get the same id back (idempotent). A higher epoch is a
        new incarnation: it keeps the id but must resync before its batches are applied.
        Raises :class:`StaleEpoch` when a higher epoch of the replica is registered.
        """
        ...

    async def heartbeat(self, worker_id: int, epoch: int, load: WorkerLoad) -> bool:
        """Renew the lease and store the load. False: the registration is gone, register again."""
        ...

    async def deregister(self, worker_id: int) -> None:
        """Drop a worker and all its entries at once."""
        ...

    async def live_workers(self) -> list[WorkerInfo]:
        """Every worker whose lease is alive."""
        ...

    async def apply(self, batch: EventBatch) -> ResultCode:
        """Apply one batch atomically: OK (also for a duplicate), STALE_EPOCH (an older epoch's
        batch, ignored) or RESYNC_NEEDED (a sequence gap, or nothing to apply it on)."""
        ...

    async def resync(self, worker_id: int, epoch: int, hashes: Iterable[bytes], seq: int) -> None:
        """Replace the worker's whole block set with ``hashes`` (the set after batch ``seq``).

        Raises :class:`StaleEpoch` or :class:`UnknownWorker` when the epoch is not the
        registered one.
        """
        ...

    async def lookup(self, chain: Sequence[bytes]) -> LookupResult:
        """The consecutive matched depth of ``chain`` of every live worker holding its first
        block, plus every live worker's id and latest load."""
        ...

    async def predict(self, chain: Sequence[bytes], worker_id: int, *, from_block: int = 0) -> None:
        """Record that ``chain`` (from block 0) was just routed to the worker, for a short while.

        ``from_block`` skips the blocks the worker already holds (its confirmed depth). A store
        may bound what one prediction writes; lookups then never report more than was routed,
        and may report less past ``IndexSettings.predict_exact_blocks``.
        """
        ...

    async def gc(self) -> int:
        """Remove every entry of dead workers (lease expired); returns entries removed."""
        ...

    async def size(self) -> IndexSize:
        """What the index holds now, counted by the store (an admin call)."""
        ...

    async def close(self) -> None:
        """Release the connection."""
        ...


_T = TypeVar("_T")


async def within(awaitable: Awaitable[_T], seconds: float) -> _T:
    """``asyncio.wait_for`` without the task it makes per call before Python 3.12: a router
    waits for a lookup on every decision. Raises ``TimeoutError`` past ``seconds``."""
    if not hasattr(asyncio, "timeout"):  # 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with asyncio.timeout(seconds):
        return await awaitable
