"""The Redis index's records as the client reads and writes them: model hash tags, worker id
codes, sampled tails of predictions, and the depths a lookup's reply encodes. Pure functions;
the key layout is in :mod:`router.redis_index`."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from functools import lru_cache

from prefixserve.router.events import pack_digests

_TAG_RE = re.compile(r"[A-Za-z0-9._-]{1,8}")
_RIDE = struct.Struct(">HI")  # lookup reply per rider: id, predicted depth
# A tail's samples: a chain that leaves the routed one between two samples is credited up to
# the earlier one, so 64 samples of a 2,048-block prompt miss at most ~31 blocks (1.5%).
_TAIL_SAMPLES = 64
_TAIL_HEAD = struct.Struct(">IH")  # from_block, samples
_TAIL_POS = struct.Struct(">I")

def key_tag(model: str) -> str:
    """The hash tag of a model: its name when short and plain, else a short digest of it.

    Short tags keep the per-block keys small (a 16-byte digest plus a few bytes).
    """
    if _TAG_RE.fullmatch(model):
        return model
    return "m" + hashlib.sha256(model.encode()).hexdigest()[:7]


def tail_record(chain: Sequence[bytes], from_block: int, start: int) -> bytes:
    """The sampled tail of a prediction (``lua/_tails.lua``, less the expiry Redis adds):
    ``_TAIL_SAMPLES`` blocks spread evenly over ``chain[start:]``, its first and last included;
    empty when the chain ends before ``start``."""
    n = len(chain) - start
    if n <= 0:
        return b""
    count = min(n, _TAIL_SAMPLES)
    positions = [start + k * (n - 1) // max(1, count - 1) for k in range(count)]
    pack_digests([chain[p] for p in positions])  # ValueError on a malformed digest
    parts = [_TAIL_HEAD.pack(from_block, count)]
    for p in positions:
        parts += (_TAIL_POS.pack(p), chain[p])
    return b"".join(parts)


def worker_code(worker_id: int) -> bytes:
    """A worker id as the scripts store it in block values and the live set: 2 bytes, BE."""
    return worker_id.to_bytes(2, "big")


# A holder's code: its worker id in the low 14 bits, the tier it holds the block in (0 the
# pool, 1 host memory, 2 disk) in the top two (router/lua/_blocks.lua).
ID_BITS = 14
ID_MASK = (1 << ID_BITS) - 1


def split_code(code: int) -> tuple[int, int]:
    """A holder code (its 2 bytes as an int) as (worker id, tier)."""
    return code & ID_MASK, code >> ID_BITS


@lru_cache(maxsize=4096)
def _ids(packed: bytes) -> frozenset[int]:
    """The worker ids packed in a lookup's reply, remembered: the same holders come back lookup
    after lookup (every worker, for a shared system prompt), and at 64 workers reading them
    again cost more than the rest of a reply's decoding."""
    return frozenset(int.from_bytes(packed[k : k + 2], "big") & ID_MASK
                     for k in range(0, len(packed) - 1, 2))


@lru_cache(maxsize=4096)
def _lower(packed: bytes) -> dict[int, int]:
    """The holders in a reply's holder string that hold the block below the pool: id -> tier
    (1 host, 2 disk). Empty, and cheap, for a fleet without KV tiers."""
    out = {}
    for k in range(0, len(packed) - 1, 2):
        wid, tier = split_code(int.from_bytes(packed[k : k + 2], "big"))
        if tier:
            out[wid] = tier
    return out


def lower_blocks(changes: Sequence[int | bytes], depths: dict[int, tuple[int, int]],
                 ) -> dict[int, tuple[int, int]]:
    """Each matched worker's confirmed blocks held below the pool, (host, disk), from the
    holders at every change (``WorkerMatch.lower_blocks``); workers with none are left out."""
    below: dict[int, int] = {}  # id -> first block (1-based) held below the pool
    on_disk: dict[int, int] = {}  # id -> first block held on disk
    for k in range(0, len(changes) - 1, 2):
        start = int(changes[k])
        for wid, tier in _lower(bytes(changes[k + 1])).items():
            below.setdefault(wid, start)
            if tier == 2:
                on_disk.setdefault(wid, start)
    out = {}
    for wid, first in below.items():
        depth = depths.get(wid, (0, 0))[0]
        pool = min(depth, first - 1)
        if depth > pool:  # then pool = first - 1 <= the first disk block - 1: host >= 0
            host = min(depth, on_disk.get(wid, depth + 1) - 1) - pool
            out[wid] = (host, depth - pool - host)
    return out


def match_depths(
    live: bytes, changes: Sequence[int | bytes], rides: bytes, walked: int
) -> dict[int, tuple[int, int]]:
    """Each live worker's (confirmed, predicted) depth from a lookup's reply: the holders at
    every change along the walk (a worker's confirmed depth ends where it leaves them, so a
    block held by every worker costs one string, not a depth each) and the riders' predicted
    depths. Workers that matched neither are left out."""
    live_ids = _ids(live)
    alive = live_ids
    confirmed: dict[int, int] = {}
    for k in range(0, len(changes) - 1, 2):
        start, holders = int(changes[k]), _ids(bytes(changes[k + 1]))
        if k:  # the first change is block 1's holders: nobody leaves there
            confirmed.update(dict.fromkeys(alive - holders, start - 1))
        alive = alive & holders
    confirmed.update(dict.fromkeys(alive, walked))
    depths = {wid: (d, d) for wid, d in confirmed.items()}
    for wid, d in _RIDE.iter_unpack(rides):
        if wid in live_ids:
            c = confirmed.get(wid, 0)
            depths[wid] = (c, max(c, d))
    return {wid: d for wid, d in depths.items() if d[1] > 0}
