"""A simulated fleet's block caches for the index tests: random prefix-closed changes, sent as
KV events, with the sets they leave to check an index against."""

from __future__ import annotations

import random

from prefixserve.router.blocks import DIGEST_BYTES
from prefixserve.router.events import (
    DEVICE,
    DISK,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)


def digests(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(DIGEST_BYTES) for _ in range(n)]


def reference(held: dict[int, set[bytes]], chain: list[bytes]) -> dict[int, int]:
    """Each worker's consecutive run of ``chain`` from block 0, block by block."""
    out = {}
    for worker, blocks in held.items():
        depth = 0
        while depth < len(chain) and chain[depth] in blocks:
            depth += 1
        if depth:
            out[worker] = depth
    return out


TIER_ORDER = {DEVICE: 0, HOST: 1, DISK: 2}


def _common(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference_lower(held: dict[int, set[bytes]], medium: dict[tuple[int, bytes], str],
                    chain: list[bytes]) -> dict[int, tuple[int, int]]:
    """Each worker's (host, disk) blocks of its depth of ``chain`` (``WorkerMatch.lower_blocks``):
    past its consecutive run in the pool, host blocks up to its run in the pool or host memory,
    disk blocks the rest; workers with none are left out."""
    out = {}
    for worker, depth in reference(held, chain).items():
        def run(media: tuple[str, ...], w: int = worker, d: int = depth) -> int:
            n = 0
            while n < d and medium[w, chain[n]] in media:
                n += 1
            return n
        pool, upper = run((DEVICE,)), run((DEVICE, HOST))
        if pool < depth:
            out[worker] = (upper - pool, depth - upper)
    return out


class Fleet:
    """Workers caching prefixes of a few shared chains as an engine does: a block only after
    the ones before it, a chain's tail evicted first. Every change goes to the index under test
    as events and to ``held`` as sets. With ``tiers``, a chain's own tail also moves down to
    host memory or disk now and then, and its head back up to the pool, as an engine's LRU
    tiers move them: along a chain the tiers only go down (``medium``: where each held block
    is), and a chain that grows is in the pool first."""

    def __init__(self, rng: random.Random, workers: int, chains: int, length: int,
                 tiers: bool = False) -> None:
        self.rng = rng
        self.tiers = tiers
        self.lower_seen = 0  # lookups that met blocks below a pool (a test's own count)
        self.medium: dict[tuple[int, bytes], str] = {}
        self.chains = [digests(rng, length) for _ in range(chains)]
        # a chain's later blocks fork: some chains share their first blocks with chain 0
        for chain in self.chains[1:]:
            cut = rng.randrange(length)
            chain[:cut] = self.chains[0][:cut]
        # how many first blocks each chain shares with another: a tier move leaves them alone
        self.shared = [max((_common(chain, other) for other in self.chains if other is not chain),
                           default=0) for chain in self.chains]
        self.held: dict[int, set[bytes]] = {w: set() for w in range(1, workers + 1)}
        self.depth = {(w, c): 0 for w in self.held for c in range(chains)}

    def step(self) -> tuple[int, list]:
        """One worker's random change: cache more of a chain, evict its tail, or clear all."""
        w = self.rng.choice(list(self.held))
        c = self.rng.randrange(len(self.chains))
        chain, depth, roll = self.chains[c], self.depth[w, c], self.rng.random()
        if roll < 0.05:
            self.held[w].clear()
            for key in self.depth:
                if key[0] == w:
                    self.depth[key] = 0
            return w, [AllBlocksCleared()]
        if roll < 0.65:
            new = min(len(chain), depth + self.rng.randint(1, 12))
            stored = tuple(chain[depth:new])
            self.held[w].update(stored)
            self.depth[w, c] = new
            if self.tiers:  # what it held lower down is loaded back before the chain grows
                stored = tuple(b for b in chain[:new] if self.medium.get((w, b)) != DEVICE
                               or b in stored)
            self.medium.update(((w, b), DEVICE) for b in stored)
            return w, [BlockStored(stored)] if stored else []
        if self.tiers and roll < 0.75:  # its own tail from some block on moves down
            medium = self.rng.choice((HOST, DISK))
            start = self.rng.randint(min(self.shared[c], depth), depth)
            moved = tuple(b for b in chain[start:depth]
                          if TIER_ORDER[self.medium[w, b]] < TIER_ORDER[medium])
            self.medium.update(((w, b), medium) for b in moved)
            return w, [BlockStored(moved, medium)] if moved else []
        if self.tiers and roll < 0.8:  # its head comes back to the pool
            moved = tuple(b for b in chain[: self.rng.randint(0, depth)]
                          if self.medium[w, b] != DEVICE)
            self.medium.update(((w, b), DEVICE) for b in moved)
            return w, [BlockStored(moved)] if moved else []
        cut = self.rng.randint(0, depth)
        # a block another held chain of this worker still needs stays (shared prefixes)
        keep = {b for (ww, cc), d in self.depth.items() if ww == w and cc != c
                for b in self.chains[cc][:d]}
        removed = tuple(b for b in chain[cut:depth] if b not in keep)
        self.held[w].difference_update(removed)
        self.depth[w, c] = cut
        return w, [BlockRemoved(removed)] if removed else []

    def query(self) -> list[bytes]:
        chain = self.rng.choice(self.chains)
        return chain[: self.rng.randint(0, len(chain))]
