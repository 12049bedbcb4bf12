"""TieredKV: the engine's pool over a host tier and a disk tier (either may be absent).

Where blocks go:

- **Offload on eviction.** When the pool evicts a committed hashed block (``BlockPool.on_evict``,
  before anything overwrites it), its KV is copied into the host tier, unless the host tier has
  it already (then it is only touched: a block is offloaded once). The host tier's own LRU
  victims go to disk the same way.
- **Write-behind to disk.** Every block the pool commits is also queued for the disk tier
  (``BlockPool.on_commit``), so a worker killed at any moment leaves its prefixes on disk for the
  next one: a warm restart does not wait for blocks to be evicted twice.
- **Load on lookup.** A waiting sequence's prefix walk goes on past the pool's hits into the host
  and disk tiers (:meth:`start_load`). Its blocks are taken from the pool, host copies are
  written into them at once (a memory copy), disk copies are read on the disk tier's reader
  thread while the sequence waits in the loading state; the engine thread writes them into the
  pool when :meth:`poll` finds them done, and the sequence is scheduled with them as prefix hits.
  A copy that fails any check is a miss, counted, recomputed; nothing unchecked is loaded.

Events: a block's ``BlockStored`` carries the best tier the worker holds it in; a block leaving
the pool for a lower tier is reported stored there, and ``BlockRemoved`` only when no tier
holds it. One block is one cached block wherever its copies are: the pool's copy wins lookups.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from prefixserve.router.events import BlockRemoved, BlockStored
from prefixserve.workers.kv_cache import Block, KVCacheManager
from prefixserve.workers.kv_tiers.base import (
    DEVICE,
    DISK,
    HOST,
    LoadFailed,
    TierCounters,
    Waiting,
)
from prefixserve.workers.kv_tiers.block_io import BlockIO
from prefixserve.workers.kv_tiers.disk import DiskTier
from prefixserve.workers.kv_tiers.host import HostTier


@dataclass(eq=False)
class LoadJob:
    """A waiting sequence's loads: the pool blocks they fill, in chain order, each with the
    tier it comes from (host copies are written at once, disk ones when read)."""

    seq: Waiting
    targets: list[tuple[bytes, Block, str]]
    future: concurrent.futures.Future
    started: float
    generation: int


class TieredKV:
    """See the module docstring. Engine-thread only, like the pool it serves."""

    def __init__(self, kv: KVCacheManager, io: BlockIO | None, host: HostTier | None,
                 disk: DiskTier | None, block_bytes: int,
                 rates: dict[str, float] | None = None) -> None:
        """`io` moves block contents (None: the simulator's tiers keep bookkeeping only);
        `block_bytes` is one block's size, for the counters; `rates` are load rates (tokens
        a second, by medium) to report instead of measured ones (the simulator's modelled)."""
        self.kv = kv
        self.block_bytes = block_bytes
        self.rates = rates
        self.pool = kv.pool
        self.io = io
        self.host = host
        self.disk = disk
        self.jobs: dict[str, LoadJob] = {}  # by sequence id
        self.counters = TierCounters()
        self._generation = 0  # bumped by `clear`: loads begun before it are dropped
        self.pool.on_evict = self._evicted
        if disk is not None:
            self.pool.on_commit = self._committed

    def announce(self) -> None:
        """Report what the disk tier found at start (a warm restart) as held on disk."""
        if self.disk is not None and self.disk.files:
            self.pool.events.append(BlockStored(tuple(self.disk.files), DISK))

    # ----------------------------------------------------------------- where a block is

    def medium(self, block_hash: bytes) -> str | None:
        """The best tier holding `block_hash`; None: none does."""
        if block_hash in self.pool.cached:
            return DEVICE
        if self.host is not None and block_hash in self.host:
            return HOST
        if self.disk is not None and block_hash in self.disk:
            return DISK
        return None

    def _report(self, hashes: Iterable[bytes]) -> None:
        """Events for blocks that left a tier: stored in the best tier left, else removed."""
        by_medium: dict[str | None, list[bytes]] = {}
        for block_hash in hashes:
            by_medium.setdefault(self.medium(block_hash), []).append(block_hash)
        for medium, group in by_medium.items():
            if medium is None:
                self.pool.events.append(BlockRemoved(tuple(group)))
            elif medium != DEVICE:
                self.pool.events.append(BlockStored(tuple(group), medium))

    def snapshot(self) -> TierCounters:
        """The counters now, with the host tier's usage."""
        host = self.host
        return self.counters.snapshot(0.0 if host is None else len(host) / host.num_slots)

    def load_rates(self) -> dict[str, float]:
        """Tokens a second each tier has loaded at, from start to blocks in the pool, over
        every load so far (``EngineStats``' ``host_``/``disk_load_tokens_per_s``)."""
        if self.rates is not None:
            return {f"{medium}_load_tokens_per_s": rate for medium, rate in self.rates.items()}
        tokens_per_byte = self.kv.block_size / self.block_bytes
        return {f"{medium}_load_tokens_per_s": self.counters.loaded_bytes[medium]
                * tokens_per_byte / self.counters.load_s[medium]
                for medium in (HOST, DISK) if self.counters.load_s.get(medium)}

    def hashes(self) -> list[bytes]:
        """Every block held below the pool."""
        out = list(self.host.slots) if self.host is not None else []
        if self.disk is not None:
            out.extend(self.disk.files)
            out.extend(self.disk.pending)
        return out

    # ----------------------------------------------------------------- storing

    def _evicted(self, evicted: list[tuple[bytes, Block]]) -> None:
        """The pool evicts these blocks (KV still intact): keep them below it."""
        start = time.perf_counter()
        host, io = self.host, self.io
        stored = 0
        for block_hash, block in evicted:
            if host is not None:
                if block_hash in host:
                    host.touch(block_hash)
                    continue
                spilled = host.evict_lru()
                if spilled is not None:
                    self._spill(*spilled)
                slot = host.put(block_hash)
                if io is not None and slot is not None:
                    io.read_into(block.block_id, slot)
                stored += 1
            elif self.disk is not None and io is not None:
                self._to_disk(block_hash, lambda b=block: io.read(b.block_id))
        if stored:
            self._count_offload(HOST, stored, start)
        self._report(h for h, _ in evicted)
        self._reap_disk()

    def _spill(self, block_hash: bytes, data: torch.Tensor | None) -> None:
        """The host tier's LRU victim goes to disk (its slot is reused next: copy it now)."""
        if self.disk is not None and data is not None:
            if self.io is not None:
                self.io.settle()  # the slot's own copy in may still be under way
            self._to_disk(block_hash, data.clone)
        if block_hash not in self.pool.cached:
            self._report((block_hash,))

    def _to_disk(self, block_hash: bytes, data: Callable[[], torch.Tensor]) -> None:
        """Queue the block for disk, unless held there already (then only touched); ``data``
        makes its copy, called only if it is written."""
        disk = self.disk
        assert disk is not None
        if block_hash in disk:
            disk.touch(block_hash)
            return
        start = time.perf_counter()
        skipped = disk.store(block_hash, data())
        if skipped is not None:
            self.counters.store_skips[skipped] += 1
        else:
            self._count_offload(DISK, 1, start)

    def _committed(self, blocks: list[Block]) -> None:
        """Write-behind: queue each newly committed block for disk (module docstring)."""
        io, disk = self.io, self.disk
        if io is None or disk is None:
            return
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                self._to_disk(block_hash, lambda b=block: io.read(b.block_id))
        self._reap_disk()

    def _count_offload(self, medium: str, blocks: int, start: float) -> None:
        self.counters.offloaded_bytes[medium] += blocks * self.block_bytes
        self.counters.offload_s[medium] += time.perf_counter() - start

    def _reap_disk(self) -> None:
        """Take in the disk writer's results and the disk tier's evictions; report blocks
        that no tier holds any more."""
        disk = self.disk
        if disk is None:
            return
        gone = []
        for block_hash, reason in disk.reap():
            self.counters.store_skips[reason] += 1
            gone.append(block_hash)
        gone.extend(disk.evicted)
        disk.evicted.clear()
        self._report(h for h in gone if self.medium(h) is None)

    # ----------------------------------------------------------------- loading

    def start_load(self, seq: Waiting, hits: list[Block]) -> bool:
        """Extend `seq`'s pool hits from the tiers below: take pool blocks for the next blocks
        of its chain held lower, fill host ones now, start reading disk ones. True when it
        must wait for the disk (:meth:`poll` hands it back). When the pool has room for only
        some of them (none: nothing is held), `seq` is marked to search again at its next
        turn, so what is lower down still loads once running sequences give blocks back."""
        kv, pool, host, disk = self.kv, self.pool, self.host, self.disk
        plan: list[tuple[bytes, str]] = []
        for block_hash in kv.reusable(seq.hashes, seq.num_tokens)[len(hits):]:
            if block_hash in pool.cached:
                break
            if host is not None and block_hash in host:
                plan.append((block_hash, HOST))
                host.touch(block_hash)  # evicted last while the pool makes room below
            elif disk is not None and disk.readable(block_hash):
                plan.append((block_hash, DISK))
            else:
                break
        if not plan:
            return False
        room = min(len(plan), pool.num_free_besides(hits))  # once the hits are held
        if room < len(plan):
            seq.tiers_checked = False
        if room <= 0:
            return False
        kv.hold(seq.seq_id, hits)  # the pool may evict to make room: not these
        blocks = pool.allocate(room)
        kv.hold(seq.seq_id, blocks, referenced=True)
        start = time.perf_counter()
        targets: list[tuple[bytes, Block, str]] = []
        for (block_hash, medium), block in zip(plan, blocks, strict=False):
            if medium == HOST:
                if block_hash not in host:  # evicted while the pool made room
                    break
                if self.io is not None:
                    self.io.write(block.block_id, host.get(block_hash))
            targets.append((block_hash, block, medium))
        reads = [h for h, _, medium in targets if medium == DISK]
        if not reads:  # host copies only: in the pool now
            self._register(seq, targets, [], start)
            return False
        assert disk is not None
        self.jobs[seq.seq_id] = LoadJob(seq, targets, disk.read_many(reads), start,
                                        self._generation)
        return True

    def poll(self) -> list[Waiting]:
        """The sequences whose disk reads finished, their blocks now in the pool (up to the
        first that failed: a miss, counted by reason)."""
        self._reap_disk()
        ready = [job for job in self.jobs.values() if job.future.done()]
        for job in ready:
            del self.jobs[job.seq.seq_id]
            if job.generation != self._generation:
                continue  # the cache was cleared meanwhile
            try:
                results = job.future.result()
            except Exception as exc:  # the reader itself failed: everything is a miss
                results = [LoadFailed("read_error", str(exc))]
            self._register(job.seq, job.targets, results, job.started)
        return [job.seq for job in ready]

    def _register(self, seq: Waiting, targets: list[tuple[bytes, Block, str]],
                  reads: list[torch.Tensor | LoadFailed], start: float) -> None:
        """Cache the loaded blocks under their hashes, in chain order, up to the first disk
        read that failed (or never ran: the reader stops at a failure)."""
        results = iter(reads)
        loaded = {HOST: 0, DISK: 0}
        for block_hash, block, medium in targets:
            if medium == DISK:
                result = next(results, None)
                if not isinstance(result, torch.Tensor):
                    if isinstance(result, LoadFailed):
                        self.counters.load_failures[result.reason] += 1
                        assert self.disk is not None
                        self.disk.discard(block_hash)
                        if self.medium(block_hash) is None:
                            self._report((block_hash,))
                    break
                if self.io is not None:
                    self.io.write(block.block_id, result)
            self.pool.cache([block], [block_hash])
            loaded[medium] += 1
        seq.loaded_blocks += loaded[HOST] + loaded[DISK]
        for medium, count in loaded.items():
            if count:
                self._count_load(medium, count, start)

    def _count_load(self, medium: str, blocks: int, start: float) -> None:
        self.counters.loaded_bytes[medium] += blocks * self.block_bytes
        self.counters.load_s[medium] += time.perf_counter() - start

    def cancel(self, seq_id: str) -> None:
        """Forget a sequence's loads (aborted): its blocks are freed with it, never written."""
        self.jobs.pop(seq_id, None)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a load finishes or `timeout_s` passes (the engine has nothing else)."""
        if self.jobs:
            concurrent.futures.wait([j.future for j in self.jobs.values()], timeout_s,
                                    concurrent.futures.FIRST_COMPLETED)

    def clear(self) -> None:
        """Drop every block below the pool (the prefix cache is reset)."""
        self._generation += 1
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        """Finish the disk tier's writes and release its folder."""
        if self.disk is not None:
            self.disk.close()
