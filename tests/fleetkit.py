"""A simulated fleet's block caches for the index tests: random prefix-closed changes, sent as
KV events, with the sets they leave to check an index against."""

from __future__ import annotations

import random

from prefixserve.router.blocks import DIGEST_BYTES
from prefixserve.router.events import AllBlocksCleared, BlockRemoved, BlockStored


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


class Fleet:
    """Workers caching prefixes of a few shared chains as an engine does: a block only after
    the ones before it, a chain's tail evicted first. Every change goes to the index under test
    as events and to ``held`` as sets."""

    def __init__(self, rng: random.Random, workers: int, chains: int, length: int) -> None:
        self.rng = rng
        self.chains = [digests(rng, length) for _ in range(chains)]
        # a chain's later blocks fork: some chains share their first blocks with chain 0
        for chain in self.chains[1:]:
            cut = rng.randrange(length)
            chain[:cut] = self.chains[0][:cut]
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
            return w, [BlockStored(stored)] if stored else []
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
