"""An index client's copy of the live workers and their loads, refreshed from the store's
replies. Each lookup hands out the same maps until news replaces them (never changes them), so
a :class:`router.index.LookupResult` needs no copy."""

from __future__ import annotations

import logging
import time
from collections.abc import KeysView, Mapping
from typing import Any

from prefixserve.router.events import EventDecodeError, WorkerLoad, decode_load
from prefixserve.router.index import Matches, WorkerInfo
from prefixserve.router.load_table import LoadMap, LoadTable

log = logging.getLogger(__name__)


class WorkerCache:
    """The live workers by id, their latest loads, and which stray ids are known to be junk."""

    def __init__(self, tag: str) -> None:
        self.tag = tag  # names the index in warnings
        self.workers: dict[int, WorkerInfo] = {}
        self.version: bytes | None = None  # the registry version the list was read at
        self.loads_version = b""  # the load version of the last lookup's reply
        self._loads: dict[int, tuple[bytes, WorkerLoad | None]] = {}  # raw, decoded (None: junk)
        # replica_id -> load / worker id of every known live worker; replaced on news
        self.by_replica: LoadMap = LoadMap(())
        self._table = LoadTable()  # the loads' rows
        self.ids: Mapping[str, int] = {}
        self._corrupt: set[Any] = set()  # worker ids whose junk record was logged once
        # ids in lookups' replies that the last list of live workers did not know, until when
        self._strays: frozenset[int] = frozenset()
        self._strays_until = 0.0

    def replace(self, version: bytes, flat: list[Any]) -> list[WorkerInfo]:
        """Take a fresh list of the live workers (id, record pairs); junk records are skipped
        and logged once."""
        workers = []
        for i in range(0, len(flat), 2):
            try:
                rid, epoch, bs, fp, node = flat[i + 1]
                if rid is None:  # no record (gone, or not a hash): not a worker
                    continue
                workers.append(WorkerInfo(int(flat[i]), rid.decode(), int(epoch), int(bs),
                                          fp.decode(), (node or b"").decode()))
            except (TypeError, ValueError, AttributeError) as exc:  # junk in the record
                if flat[i] not in self._corrupt:
                    self._corrupt.add(flat[i])
                    log.warning("prefix index %s: corrupt record of worker %r skipped (%r)",
                                self.tag, flat[i], exc)
        self.workers = {w.worker_id: w for w in workers}
        self.version = version
        self.ids = {w.replica_id: w.worker_id for w in workers}
        gone = self._loads.keys() - self.workers.keys()
        for wid in gone:
            del self._loads[wid]
        self._table.forget(gone)
        self._publish_loads()
        return workers

    def needs_list(self, version: bytes, ids: KeysView[int]) -> bool:
        """Whether a reply calls for a fresh list of the live workers: the registry changed, or
        it names ids no known worker has. Not when the last list, fetched less than a lease ago,
        lacked them too (junk, or a dead worker whose entries the sweep is removing), so they
        cost one list, not one per lookup."""
        if version != self.version:
            return True
        unknown = ids - self.workers.keys()
        return bool(unknown) and (not unknown <= self._strays
                                  or time.monotonic() >= self._strays_until)

    def note_strays(self, ids: KeysView[int], lease_ttl_s: float) -> None:
        """The ids a fresh list still lacks: not worth another list for a lease."""
        self._strays = frozenset(ids - self.workers.keys())
        self._strays_until = time.monotonic() + lease_ttl_s

    def take_loads(self, changed: list[Any], everything: bool) -> None:
        """The loads a lookup's reply carried (id, packed load or False pairs); ``everything``:
        they are all the loads there are, so the rest are gone."""
        news = {int.from_bytes(changed[i], "big"): changed[i + 1] or None  # False: no load
                for i in range(0, len(changed) - 1, 2) if len(changed[i]) == 2}
        if everything:
            gone = self._loads.keys() - news.keys()
            for wid in gone:
                del self._loads[wid]
            self._table.forget(gone)
        changed = [self._decode_load(wid, raw) for wid, raw in news.items()]
        if everything or any(changed):  # else the last map stands
            self._publish_loads()

    def matches(self, depth: Mapping[int, tuple[int, int]],
                lower: Mapping[int, tuple[int, int]] | None = None) -> Matches:
        """The known workers among matched ids (confirmed, predicted depth; ``lower``: their
        blocks below the pool, where some are), with their loads."""
        workers = self.workers
        ids = [wid for wid in depth if wid in workers]
        names = [workers[wid].replica_id for wid in ids]
        return Matches(names, ids, [depth[w][0] for w in ids], [depth[w][1] for w in ids],
                       self.by_replica,
                       {workers[w].replica_id: v for w, v in (lower or {}).items()
                        if w in workers})

    def forget(self, worker_id: int) -> None:
        """A worker collected by GC."""
        self.workers.pop(worker_id, None)
        self._loads.pop(worker_id, None)
        self._table.forget((worker_id,))

    def _publish_loads(self) -> None:
        self.by_replica = self._table.publish({
            wid: (info.replica_id, cached[1])
            for wid, info in self.workers.items()
            if (cached := self._loads.get(wid)) is not None and cached[1] is not None
        })

    def _decode_load(self, worker_id: int, raw: bytes | None) -> bool:
        """Take one worker's load record; whether its load changed."""
        if raw is None:
            self._table.forget((worker_id,))
            return self._loads.pop(worker_id, None) is not None
        cached = self._loads.get(worker_id)
        if cached is not None and cached[0] == raw:
            return False
        try:
            load = decode_load(raw)
        except EventDecodeError as exc:
            if cached is None or cached[1] is not None:
                log.warning("prefix index %s: bad load record of worker %d ignored (%s)",
                            self.tag, worker_id, exc)
            load = None
        else:
            self._table.write(worker_id, load)
        self._loads[worker_id] = (raw, load)
        return True
