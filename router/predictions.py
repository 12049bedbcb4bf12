"""A router's own recent decisions, which predict what each worker will hold before the
index hears of it."""

from __future__ import annotations

from collections import deque

from prefixserve.router.blocks import Chain
from prefixserve.router.chains import common_blocks, shares_block


class LocalPredictions:
    """This router's own recent decisions: the chains it sent to each worker, each expiring
    after ``ttl_s``, at most ``max_blocks`` blocks in all (the oldest go first).

    A worker's predicted depth for a chain is its longest common prefix with a chain recently
    sent there: chained hashes make a block equal only when everything before it is, so that is
    the consecutive run from block 0. Recording is O(1); a query compares one block per recent
    chain and binary-searches only a chain that goes deeper than its worker's depth found so far
    (with a shared system prompt, a few per worker rather than every recent request), so a long
    prompt costs no per-block work here.
    """

    def __init__(self, ttl_s: float, max_blocks: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        # (expiry, worker, chain, its length when recorded), in expiry order
        self._sent: deque[tuple[float, str, Chain, int]] = deque()
        self.num_blocks = 0

    def record(self, chain: Chain, worker: str, now: float) -> None:
        self._sent.append((now + self.ttl_s, worker, chain, len(chain)))
        self.num_blocks += len(chain)
        self._expire(now)

    def _expire(self, now: float) -> None:
        sent = self._sent
        while sent and (sent[0][0] <= now or self.num_blocks > self.max_blocks):
            self.num_blocks -= sent.popleft()[3]  # as recorded: a chain may grow after

    def depths(self, chain: Chain, now: float) -> dict[str, int]:
        """Consecutive predicted depth from block 0, per worker."""
        self._expire(now)
        depth: dict[str, int] = {}
        if not chain:
            return depth
        for _, worker, sent, _ in self._sent:
            best = depth.get(worker, 0)
            # one comparison rules out a chain that cannot go deeper (at a high request rate
            # most share only a system prompt): no binary search per recent chain
            if shares_block(chain, sent, best):
                depth[worker] = common_blocks(chain, sent, best + 1)
        return depth

    def chains(self, now: float) -> list[Chain]:
        """The chains sent in the last ``ttl_s``."""
        self._expire(now)
        return [sent for _, _, sent, _ in self._sent]
