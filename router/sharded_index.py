"""One model's prefix index split over ``IndexSettings.shards`` stores (worker groups).

A store keeps a model under one key prefix; in Redis that is one hash tag, so one Cluster slot
and one Redis thread, whatever the Cluster's size. A fleet whose KV events outrun one Redis core
(1,000 GPUs store and evict ~1.2M blocks/s) splits its workers into K groups instead: group
``g`` is the store of the model named ``<model>#<g>``, whose tag lands on its own slot. A
worker's registration, events and heartbeats go to its group only; a lookup asks the K groups
at once and merges their replies (their workers are disjoint); a predicted entry goes to the
group of the worker it names. Blocks held in two groups cost an entry in each.

Why workers and not blocks: a worker's batch of events touches one group, so it still applies
atomically, and a fleet's event rate splits evenly over the groups whatever its prompts share;
keyed by block, every worker's events for a popular system prompt would meet on one shard, and a
batch would span shards. A lookup asks each group once, all at once: one round trip.

A group that fails a lookup (down, or slower than the deadline) leaves its part of the answer
unknown (:attr:`LookupResult.unknown`) and is not asked again for ``shard_backoff_s``; the
lookup answers from the other groups, and fails only when none answered.

Worker ids returned here carry the group: ``group * GROUP_SPAN + id in the group``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from prefixserve.router.events import EventBatch, WorkerLoad
from prefixserve.router.index import (
    IndexSettings,
    IndexSize,
    IndexUnavailable,
    LookupResult,
    Matches,
    PrefixIndex,
    ResultCode,
    WorkerInfo,
)
from prefixserve.router.load_table import LoadMap

logger = logging.getLogger(__name__)

GROUP_SPAN = 1 << 16  # a store's worker ids are 1..16383 (fit in 16 bits)
T = TypeVar("T")


def group_name(model: str, group: int) -> str:
    """The name a group's store knows the model by (its own key prefix)."""
    return f"{model}#{group}"


def groups_of(replica_id: str, shards: int) -> tuple[int, int]:
    """A replica's two candidate groups, from a hash of its id (one group twice when there is
    one): stable across restarts, so a new incarnation finds the group it is live in."""
    h = int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "big")
    first = h % shards
    if shards == 1:
        return first, first
    return first, (first + 1 + h // shards % (shards - 1)) % shards


class ShardedPrefixIndex:
    """:class:`router.index.PrefixIndex` over one store per worker group."""

    def __init__(
        self,
        model: str,
        settings: IndexSettings,
        open_store: Callable[[str], PrefixIndex],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``open_store(name)`` opens one group's store (the URL's store, unsharded)."""
        self.model = model
        self.stores = [open_store(group_name(model, g)) for g in range(settings.shards)]
        self.lease_ttl_s = self.stores[0].lease_ttl_s
        self.admin_deadline_s = self.stores[0].admin_deadline_s
        self.backoff_s = settings.shard_backoff_s
        self.clock = clock
        self._down_until = [0.0] * len(self.stores)  # per group: not asked before then
        self._last = [LookupResult({})] * len(self.stores)  # per group: its latest answer
        self._merged: tuple[tuple[Mapping, ...], Mapping[str, WorkerLoad], Mapping[str, int]]
        self._merged = ((), {}, {})

    def backing_off(self) -> list[int]:
        """The groups whose part of a lookup is unknown now, without asking them."""
        now = self.clock()
        return [g for g, until in enumerate(self._down_until) if now < until]

    def _split(self, worker_id: int) -> tuple[PrefixIndex, int]:
        group, local = divmod(worker_id, GROUP_SPAN)
        if not 0 <= group < len(self.stores):
            raise ValueError(f"worker id {worker_id} names no group of {len(self.stores)}")
        return self.stores[group], local

    async def register(
        self, replica_id: str, *, epoch: int, block_size: int, fingerprint: str, node: str = ""
    ) -> int:
        group = await self._group_for(replica_id)
        local = await self.stores[group].register(
            replica_id, epoch=epoch, block_size=block_size, fingerprint=fingerprint, node=node)
        return group * GROUP_SPAN + local

    async def _group_for(self, replica_id: str) -> int:
        """Of the replica's two candidate groups, the one it is live in, else the one with fewer
        live workers (the first on a tie; the one that answers when the other fails). One hashed
        choice leaves K groups of n workers about sqrt(n/K) apart (1,000 workers over 6: 159 to
        181), and the largest group's shard is the fleet's bottleneck in events and memory; the
        less full of two keeps them within a few workers (165 to 167)."""
        first, second = groups_of(replica_id, len(self.stores))
        if first == second:
            return first
        live = await self._each(lambda s: s.live_workers(), (first, second))
        for g, workers in live.items():
            if any(w.replica_id == replica_id for w in workers):
                return g
        return min(live, key=lambda g: (len(live[g]), g != first))

    async def heartbeat(self, worker_id: int, epoch: int, load: WorkerLoad) -> bool:
        store, local = self._split(worker_id)
        return await store.heartbeat(local, epoch, load)

    async def deregister(self, worker_id: int) -> None:
        store, local = self._split(worker_id)
        await store.deregister(local)

    async def live_workers(self) -> list[WorkerInfo]:
        """The groups that answer; fails only when none does."""
        groups = await self._each(lambda s: s.live_workers(), range(len(self.stores)))
        return [dataclasses.replace(w, worker_id=g * GROUP_SPAN + w.worker_id)
                for g, workers in groups.items() for w in workers]

    async def _each(self, call: Callable[[PrefixIndex], Awaitable[T]],
                    groups: Iterable[int]) -> dict[int, T]:
        """``call`` on each group's store at once: the answers by group, the failed left out
        (and backed off from); the first failure is raised when every group failed."""
        groups = list(groups)
        replies = await asyncio.gather(*(call(self.stores[g]) for g in groups),
                                       return_exceptions=True)
        answers: dict[int, T] = {}
        failures: list[Exception] = []
        for g, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                self._down_until[g] = self.clock() + self.backoff_s
                failures.append(reply)
                logger.warning("index shard %s failed (%r): its part of lookups is unknown "
                               "for %.1f s", group_name(self.model, g), reply, self.backoff_s)
            elif isinstance(reply, BaseException):  # cancelled, or the process is exiting
                raise reply
            else:
                answers[g] = reply
        if failures and not answers:
            raise failures[0]
        return answers

    async def apply(self, batch: EventBatch) -> ResultCode:
        store, local = self._split(batch.worker_id)
        return await store.apply(dataclasses.replace(batch, worker_id=local))

    async def resync(self, worker_id: int, epoch: int, hashes: Iterable[bytes], seq: int) -> None:
        store, local = self._split(worker_id)
        await store.resync(local, epoch, hashes, seq)

    async def lookup(self, chain: Sequence[bytes]) -> LookupResult:
        """The groups' lookups at once, less those backing off; a group that fails is left
        unknown (its workers as last known). Fails when no group answered (the router fails
        open)."""
        down = set(self.backing_off())
        if len(down) == len(self.stores):
            raise IndexUnavailable(f"every shard of {self.model}'s index is backing off")
        answers = await self._each(lambda s: s.lookup(chain),
                                   (g for g in range(len(self.stores)) if g not in down))
        names: list[str] = []
        worker_ids: list[int] = []
        confirmed: list[int] = []
        predicted: list[int] = []
        lower: dict[str, tuple[int, int]] = {}
        for g, result in answers.items():
            self._last[g] = result
            m = result.matches
            names += m.names
            worker_ids += [g * GROUP_SPAN + w for w in m.ids]
            confirmed += m.confirmed
            predicted += m.predicted
            lower.update(m.lower)
        loads, ids = self._merge(self._last)
        matches = Matches(names, worker_ids, confirmed, predicted, loads, lower)
        unknown = [g for g in range(len(self.stores)) if g not in answers]
        return LookupResult(
            matches, max(r.blocks_walked for r in answers.values()), loads, ids,
            frozenset(k for g in unknown for k in self._last[g].worker_ids), len(unknown))

    def _merge(
        self, results: Sequence[LookupResult]
    ) -> tuple[Mapping[str, WorkerLoad], Mapping[str, int]]:
        """Every group's loads and ids in one mapping each, rebuilt only when a group's changed
        (a store hands out the same mapping objects until news arrive)."""
        token = tuple(m for r in results for m in (r.loads, r.worker_ids))
        last = self._merged[0]
        if len(last) != len(token) or any(a is not b for a, b in zip(last, token, strict=True)):
            ids: dict[str, int] = {}
            for g, result in enumerate(results):
                ids.update({k: g * GROUP_SPAN + v for k, v in result.worker_ids.items()})
            self._merged = (token, LoadMap.merged([r.loads for r in results]), ids)
        return self._merged[1], self._merged[2]

    async def predict(self, chain: Sequence[bytes], worker_id: int, *, from_block: int = 0) -> None:
        store, local = self._split(worker_id)
        await store.predict(chain, local, from_block=from_block)

    async def gc(self) -> int:
        """Every group that answers is collected; fails only when none does."""
        return sum((await self._each(lambda s: s.gc(), range(len(self.stores)))).values())

    async def size(self) -> IndexSize:
        return sum(await asyncio.gather(*(s.size() for s in self.stores)), IndexSize(0, 0, 0))

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.stores), return_exceptions=True)
