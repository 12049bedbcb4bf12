"""One model's prefix index split over ``IndexSettings.shards`` stores (worker groups).

A store keeps a model under one key prefix; in Redis that is one hash tag, so one Cluster slot
and one Redis thread, whatever the Cluster's size. A fleet whose KV events outrun one Redis core
(1,000 GPUs store and evict ~1.2M blocks/s) splits its workers into K groups instead: group
``g`` is the store of the model named ``<model>#<g>``, whose tag lands on its own slot. A
worker's registration, events and heartbeats go to its group only; a lookup asks the K groups
at once and merges their replies (their workers are disjoint); a predicted entry goes to the
group of the worker it names. Blocks held in two groups cost an entry in each.

Worker ids returned here carry the group: ``group * GROUP_SPAN + id in the group``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

from prefixserve.router.events import EventBatch, WorkerLoad
from prefixserve.router.index import (
    IndexSettings,
    IndexSize,
    LookupResult,
    PrefixIndex,
    ResultCode,
    WorkerInfo,
)

GROUP_SPAN = 1 << 16  # a store's worker ids are 1..65535


def group_name(model: str, group: int) -> str:
    """The name a group's store knows the model by (its own key prefix)."""
    return f"{model}#{group}"


def group_of(replica_id: str, shards: int) -> int:
    """A replica's group: stable across restarts, so a new incarnation finds its old id."""
    digest = hashlib.blake2b(replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


class ShardedPrefixIndex:
    """:class:`router.index.PrefixIndex` over one store per worker group."""

    def __init__(
        self,
        model: str,
        settings: IndexSettings,
        open_store: Callable[[str], PrefixIndex],
    ) -> None:
        """``open_store(name)`` opens one group's store (the URL's store, unsharded)."""
        self.model = model
        self.stores = [open_store(group_name(model, g)) for g in range(settings.shards)]
        self.lease_ttl_s = self.stores[0].lease_ttl_s
        self.admin_deadline_s = self.stores[0].admin_deadline_s
        self._merged: tuple[tuple[Mapping, ...], Mapping[str, WorkerLoad], Mapping[str, int]]
        self._merged = ((), {}, {})

    def _split(self, worker_id: int) -> tuple[PrefixIndex, int]:
        group, local = divmod(worker_id, GROUP_SPAN)
        if not 0 <= group < len(self.stores):
            raise ValueError(f"worker id {worker_id} names no group of {len(self.stores)}")
        return self.stores[group], local

    async def register(
        self, replica_id: str, *, epoch: int, block_size: int, fingerprint: str, node: str = ""
    ) -> int:
        group = group_of(replica_id, len(self.stores))
        local = await self.stores[group].register(
            replica_id, epoch=epoch, block_size=block_size, fingerprint=fingerprint, node=node)
        return group * GROUP_SPAN + local

    async def heartbeat(self, worker_id: int, epoch: int, load: WorkerLoad) -> bool:
        store, local = self._split(worker_id)
        return await store.heartbeat(local, epoch, load)

    async def deregister(self, worker_id: int) -> None:
        store, local = self._split(worker_id)
        await store.deregister(local)

    async def live_workers(self) -> list[WorkerInfo]:
        groups = await asyncio.gather(*(s.live_workers() for s in self.stores))
        return [dataclasses.replace(w, worker_id=g * GROUP_SPAN + w.worker_id)
                for g, workers in enumerate(groups) for w in workers]

    async def apply(self, batch: EventBatch) -> ResultCode:
        store, local = self._split(batch.worker_id)
        return await store.apply(dataclasses.replace(batch, worker_id=local))

    async def resync(self, worker_id: int, epoch: int, hashes: Iterable[bytes], seq: int) -> None:
        store, local = self._split(worker_id)
        await store.resync(local, epoch, hashes, seq)

    async def lookup(self, chain: Sequence[bytes]) -> LookupResult:
        """The groups' lookups at once; one failing fails the lookup (the router fails open)."""
        results = await asyncio.gather(*(s.lookup(chain) for s in self.stores))
        matches = {}
        for g, result in enumerate(results):
            for key, match in result.matches.items():
                matches[key] = dataclasses.replace(
                    match, worker_id=g * GROUP_SPAN + match.worker_id)
        loads, ids = self._merge(results)
        return LookupResult(matches, max(r.blocks_walked for r in results), loads, ids)

    def _merge(
        self, results: Sequence[LookupResult]
    ) -> tuple[Mapping[str, WorkerLoad], Mapping[str, int]]:
        """Every group's loads and ids in one mapping each, rebuilt only when a group's changed
        (a store hands out the same mapping objects until news arrive)."""
        token = tuple(m for r in results for m in (r.loads, r.worker_ids))
        last = self._merged[0]
        if len(last) != len(token) or any(a is not b for a, b in zip(last, token, strict=True)):
            loads: dict[str, WorkerLoad] = {}
            ids: dict[str, int] = {}
            for g, result in enumerate(results):
                loads.update(result.loads)
                ids.update({k: g * GROUP_SPAN + v for k, v in result.worker_ids.items()})
            self._merged = (token, loads, ids)
        return self._merged[1], self._merged[2]

    async def predict(self, chain: Sequence[bytes], worker_id: int, *, from_block: int = 0) -> None:
        store, local = self._split(worker_id)
        await store.predict(chain, local, from_block=from_block)

    async def gc(self) -> int:
        return sum(await asyncio.gather(*(s.gc() for s in self.stores)))

    async def size(self) -> IndexSize:
        return sum(await asyncio.gather(*(s.size() for s in self.stores)), IndexSize(0, 0, 0))

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.stores))
