"""The prefix index in Redis (or Valkey): each operation is one atomic Lua script (``lua/``).

All keys of a model share one Redis Cluster hash tag; ``?cluster=true`` in the URL selects the
cluster client. TLS (``rediss://``) and AUTH (``redis://user:password@host``) come with the URL.

The key layout under the model's hash tag, and what each script does to it, are documented once,
in docs/architecture.md ("Redis index"); the scripts are in ``lua/``.

Connections: setting one up (TCP, TLS, AUTH) is bounded by ``connect_timeout_s`` and not by the
deadline of the call that needed it (see :class:`_SetupOffDeadline`), so a Redis that takes
longer to connect to than a lookup may take still serves lookups once connected.

Redis must not evict keys on its own (``maxmemory-policy noeviction`` or ``volatile-*``):
a partially evicted worker could leave entries that its reverse index does not know.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import msgpack
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    RedisError,
)

from prefixserve.router import redis_scripts
from prefixserve.router.blocks import DIGEST_BYTES
from prefixserve.router.events import (
    EventBatch,
    WorkerLoad,
    encode_events,
    encode_load,
    pack_digests,
)
from prefixserve.router.index import (
    INDEX_KEY_BYTES,
    IndexSettings,
    IndexSize,
    IndexUnavailable,
    LogEntry,
    LookupResult,
    ResultCode,
    WorkerInfo,
    expect,
)
from prefixserve.router.redis_connection import CALL_DEADLINE, connect, unavailable
from prefixserve.router.redis_records import (
    key_tag,
    lower_blocks,
    match_depths,
    tail_record,
    worker_code,
)
from prefixserve.router.worker_cache import WorkerCache

log = logging.getLogger(__name__)

_GC_CHUNK = 4096
# A reverse index's sealed segments hold this many bytes each (SEG in lua/_reverse.lua)
REVERSE_SEGMENT_BYTES = 1023 * INDEX_KEY_BYTES
_RESYNC_CHUNK = 4096
_HAS_TIMEOUT = hasattr(asyncio, "timeout")
# Tails kept per worker, ~1.3 KB each (a lookup reads the live workers' tails): more long
# prompts than this routed to one worker within predict_ttl_s, each taking seconds to
# prefill, keep the newest.
MAX_TAILS = 8


class RedisPrefixIndex:
    """:class:`router.index.PrefixIndex` in one Redis (or Redis Cluster) keyspace per model."""

    def __init__(
        self,
        url: str,  # redis://, rediss:// or unix://, password included; ?cluster=true for Cluster
        model: str,
        *,
        deadline_s: float,
        settings: IndexSettings | None = None,
    ) -> None:
        settings = settings or IndexSettings()
        self.model = model
        self.tag = key_tag(model)
        self.deadline_s = deadline_s
        self.admin_deadline_s = max(settings.admin_deadline_s, deadline_s)
        self.lease_ttl_ms = max(1, int(settings.lease_ttl_s * 1000))
        self.lease_ttl_s = self.lease_ttl_ms / 1000
        self.predict_ttl_ms = max(1, int(settings.predict_ttl_s * 1000))
        self.predict_exact_blocks = settings.predict_exact_blocks
        self._url = url
        self._redis = connect(url, self.admin_deadline_s, settings.connect_timeout_s)
        p = self._prefix = "{" + self.tag + "}"
        self._k_reg, self._k_ids, self._k_live = p + "reg", p + "ids", p + "live"
        self._k_load, self._k_rv, self._k_name = p + "load", p + "rv", p + "name"
        self._k_lv, self._k_tails, self._k_lz = p + "lv", p + "T", p + "lz"
        self._k_blocks, self._k_log = p + "B", p + "E"
        self._k_log_n, self._k_log_cap = p + "En", p + "Ecap"
        self._scripts = {
            name: self._redis.register_script(redis_scripts.source(name))
            for name in redis_scripts.SCRIPTS
        }
        self.cache = WorkerCache(self.tag)  # the live workers and their loads

    # -- plumbing -----------------------------------------------------------------------

    async def _eval(
        self, name: str, keys: list[str], args: list[Any], deadline_s: float | None = None
    ) -> Any:
        """Run script ``name`` within the deadline (default: ``deadline_s``)."""
        script = self._scripts[name]
        return await self._call(lambda: script(keys=keys, args=args), deadline_s)

    async def _call(
        self, command: Callable[[], Awaitable[Any]], deadline_s: float | None = None
    ) -> Any:
        """Run ``command`` within the deadline (default: ``deadline_s``), connection setup not
        counted (3.11+; on 3.10 the setup counts, but outlives a call that gives up)."""
        deadline = self.deadline_s if deadline_s is None else deadline_s
        try:
            if _HAS_TIMEOUT:  # no extra task per call, unlike wait_for before 3.12
                async with asyncio.timeout(deadline) as timeout:
                    token = CALL_DEADLINE.set((timeout, deadline))
                    try:
                        return await self._attempt(command)
                    finally:
                        CALL_DEADLINE.reset(token)
            return await asyncio.wait_for(self._attempt(command), deadline)
        except asyncio.TimeoutError:
            msg = f"redis did not answer within {deadline * 1000:.0f} ms"
            raise IndexUnavailable(msg) from None
        except (RedisError, OSError) as exc:
            raise unavailable(exc, self._url) from exc

    async def _attempt(self, command: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await command()
        except ConnectionError as exc:
            if isinstance(exc, AuthenticationError):
                raise
            # A pooled connection died (a Redis restart): once more, on a fresh one. Every
            # script and read is idempotent, and the caller's deadline still bounds the total.
            return await command()

    def _w(self, worker_id: int) -> str:
        return f"{self._prefix}w:{worker_id}"

    def _r(self, worker_id: int) -> str:
        return f"{self._prefix}r:{worker_id}"

    # -- workers --------------------------------------------------------------------------

    async def register(
        self, replica_id: str, *, epoch: int, block_size: int, fingerprint: str, node: str = ""
    ) -> int:
        """See :meth:`router.index.PrefixIndex.register`; ValueError when the model's hash tag
        is another model's, RuntimeError when all 16,383 worker ids are taken."""
        if not 0 <= epoch < 2**53:  # Lua compares epochs as doubles
            raise ValueError(f"epoch must be in [0, 2**53), got {epoch}")
        keys = [self._k_reg, self._k_ids, self._k_live, self._k_rv, self._k_name]
        args = [self._prefix, replica_id, epoch, block_size, fingerprint, node,
                self.lease_ttl_ms, self.model]
        code, worker_id = await self._eval("register", keys, args)
        expect(code, f"register {replica_id} epoch {epoch} in {{{self.tag}}}")
        return int(worker_id)

    async def heartbeat(self, worker_id: int, epoch: int, load: WorkerLoad) -> bool:
        keys = [self._w(worker_id), self._k_live, self._k_load, self._k_lv, self._k_lz]
        args = [worker_code(worker_id), epoch, self.lease_ttl_ms, encode_load(load)]
        code = await self._eval("heartbeat", keys, args)
        what = f"heartbeat of worker {worker_id}"
        return expect(code, what, ResultCode.OK, ResultCode.UNKNOWN_WORKER) is ResultCode.OK

    async def deregister(self, worker_id: int) -> None:
        """Chunked, O(own blocks)."""
        for dead in await self._mark_dead(str(worker_id)):
            await self._collect(int(dead))

    async def live_workers(self) -> list[WorkerInfo]:
        keys = [self._k_live, self._k_rv]
        rv, flat = await self._eval("live", keys, [self._prefix])
        return self.cache.replace(rv, flat)

    # -- events ---------------------------------------------------------------------------

    async def apply(self, batch: EventBatch) -> ResultCode:
        keys = [self._w(batch.worker_id), self._r(batch.worker_id)]
        args = [self._prefix, batch.worker_id, batch.epoch, batch.seq,
                encode_events(batch.events)]
        code = await self._eval("apply", keys, args)
        what = f"apply of worker {batch.worker_id} epoch {batch.epoch} seq {batch.seq}"
        return expect(code, what, ResultCode.OK, ResultCode.STALE_EPOCH, ResultCode.RESYNC_NEEDED)

    async def resync(self, worker_id: int, epoch: int, hashes: Iterable[bytes], seq: int) -> None:
        """Chunked so Redis never stalls on a large set; lookups meanwhile may see a mix of the
        old and new sets, which is harmless for an advisory index."""
        packed = pack_digests(list(hashes))  # ValueError on a malformed digest
        new = dict.fromkeys(packed[i : i + INDEX_KEY_BYTES]
                            for i in range(0, len(packed), DIGEST_BYTES))
        packed_new = b"".join(new)
        keys = [self._w(worker_id), self._r(worker_id)]
        what = f"resync of worker {worker_id} epoch {epoch}"
        code, old_blob = await self._eval("resync_begin", keys, [epoch], self.admin_deadline_s)
        expect(code, what)
        old = {old_blob[i : i + INDEX_KEY_BYTES]
               for i in range(0, len(old_blob), INDEX_KEY_BYTES)}
        removes = b"".join(h for h in old if h not in new)
        step = _RESYNC_CHUNK * INDEX_KEY_BYTES
        for start in range(0, max(len(removes), len(packed_new)), step):
            args = [self._prefix, worker_id, epoch, removes[start : start + step],
                    packed_new[start : start + step]]
            code = await self._eval("resync_chunk", keys, args, self.admin_deadline_s)
            expect(code, what)
        args = [epoch, seq, packed_new, self._prefix, worker_id]
        code = await self._eval("resync_commit", keys, args, self.admin_deadline_s)
        expect(code, what)

    # -- routing --------------------------------------------------------------------------

    async def lookup(self, chain: Sequence[bytes]) -> LookupResult:
        """Matches of the workers holding block 0 only; ids and loads of every live worker, of
        which Redis sends only the loads changed since this client's last lookup."""
        keys = [self._k_live, self._k_load, self._k_rv, self._k_lv, self._k_tails, self._k_lz]
        cache = self.cache
        args = [self._prefix, pack_digests(chain), cache.loads_version]
        reply = await self._eval("lookup", keys, args)
        rv, live, segs, rides, lv, changed, everything, walked = msgpack.unpackb(reply, raw=True)
        depth = match_depths(live, segs, rides, walked)
        if cache.needs_list(rv, depth.keys()):
            await self.live_workers()
            cache.note_strays(depth.keys(), self.lease_ttl_s)
        cache.loads_version = lv
        if everything or changed:
            cache.take_loads(changed, everything)
        lower = lower_blocks(segs, depth)
        return LookupResult(cache.matches(depth, lower), walked, cache.by_replica, cache.ids)

    async def predict(self, chain: Sequence[bytes], worker_id: int, *, from_block: int = 0) -> None:
        """Predicted entries expire after ``predict_ttl_s`` (Redis clock). Blocks up to
        ``predict_exact_blocks`` past ``from_block`` get one key each; a longer chain's rest is
        one sampled tail: a prediction writes at most that many keys and one hash field,
        however long the prompt."""
        end = from_block + self.predict_exact_blocks
        exact = pack_digests(chain[from_block:end])
        if exact:
            args = [self._prefix, worker_id, self.predict_ttl_ms, exact,
                    tail_record(chain, from_block, end), MAX_TAILS]
            await self._eval("predict", [self._k_live, self._k_tails], args)

    # -- the event log (lua/_log.lua), for routers that follow it --------------------------

    async def keep_log(self, entries: int) -> None:
        """Have the scripts keep the event log, capped near ``entries`` (the last caller's)."""
        await self._call(lambda: self._redis.set(self._k_log_cap, entries), self.admin_deadline_s)

    async def log_head(self) -> tuple[bytes, int]:
        """The event log's newest entry id (``b"0-0"`` when empty) and the number of the newest
        entry ever logged (0 for none), read together."""
        entry_id, number = await self._eval(
            "log_head", [self._k_log, self._k_log_n], [], self.admin_deadline_s)
        return entry_id or b"0-0", int(number)

    async def read_log(self, after: bytes, *, count: int, wait_s: float) -> list[LogEntry]:
        """At most ``count`` entries of the event log past entry ``after``, oldest first,
        waiting up to ``wait_s`` for the first one (0: not at all; an empty list: none
        came)."""
        wait_ms = max(1, int(wait_s * 1000)) if wait_s > 0 else None  # XREAD BLOCK 0: forever
        reply = await self._call(
            lambda: self._redis.xread({self._k_log: after}, count=count, block=wait_ms),
            wait_s + self.admin_deadline_s)
        out = []
        for _, entries in reply or ():
            for entry_id, v in entries:
                out.append(LogEntry(entry_id, int(v[b"n"]), int(v[b"w"]), v[b"k"], v[b"d"]))
        return out

    async def scan_holders(self) -> AsyncIterator[tuple[bytes, bytes]]:
        """Every block of the index as (its key, its holders' 2-byte ids), in chunks: a
        follower's starting point, read while events flow (the log's entries since then
        settle what changed meanwhile)."""
        cursor: int = 0
        while True:
            cursor, chunk = await self._call(
                lambda c=cursor: self._redis.hscan(self._k_blocks, c, count=4096),
                self.admin_deadline_s)
            for key, ids in chunk.items():
                yield key, ids
            if not cursor:
                return

    # -- garbage collection ----------------------------------------------------------------

    async def gc(self) -> int:
        removed = 0
        for dead in await self._mark_dead(""):
            removed += await self._collect(int(dead))
        return removed

    async def _mark_dead(self, only_id: str) -> list[bytes]:
        keys = [self._k_reg, self._k_live, self._k_ids, self._k_load, self._k_rv, self._k_lv,
                self._k_lz]
        return await self._eval(
            "gc_mark", keys, [self._prefix, only_id], self.admin_deadline_s
        )

    async def _collect(self, worker_id: int) -> int:
        keys = [self._w(worker_id), self._r(worker_id), self._k_reg, self._k_rv]
        removed, done = 0, 0
        while not done:
            n, done = await self._eval(
                "gc_chunk", keys, [self._prefix, worker_id, _GC_CHUNK], self.admin_deadline_s
            )
            removed += n
        self.cache.forget(worker_id)
        return removed

    async def size(self) -> IndexSize:
        """Entries (each registered worker's count), distinct blocks (the block hash's fields)
        and reverse-index bytes, in one pipeline within the admin deadline."""
        async def read() -> IndexSize:
            ids = [int(i) for i in await self._redis.smembers(self._k_reg)]
            pipe = self._redis.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hget(self._w(worker_id), "n")
                pipe.hlen(self._r(worker_id) + ":s")
                pipe.strlen(self._r(worker_id))
            pipe.hlen(self._k_blocks)
            *per_worker, blocks = await pipe.execute()
            return IndexSize(sum(int(n or 0) for n in per_worker[::3]), int(blocks),
                             sum(per_worker[1::3]) * REVERSE_SEGMENT_BYTES
                             + sum(per_worker[2::3]))

        return await self._call(read, self.admin_deadline_s)

    async def close(self) -> None:
        await self._redis.aclose()
