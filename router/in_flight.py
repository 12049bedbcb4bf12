"""The ledger of requests a router sent, until each worker's reported load covers them."""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prefixserve.router.blocks import Chain
from prefixserve.router.chains import common_blocks, shares_block


@dataclass
class Routed:
    """A request this router sent, until the worker's reported load covers it."""

    worker: str
    routed_at: float
    new_tokens: int  # prompt tokens it will prefill there
    chain: Chain
    start_block: int  # its prefill starts here (the depth it was credited with)
    internal_id: str  # Serve's, for on_request_completed (shared by sibling handle calls)

    def unshared_tokens(self, chain: Chain, block_size: int) -> int:
        """Its prefill work that is not the prefix ``chain`` shares with it.

        A request that follows another with the same prefix needs that work done anyway (here
        or, twice over, elsewhere), so it must not count as a backlog that pushes it away.
        """
        start = self.start_block
        if not shares_block(self.chain, chain, start):  # nothing shared past its start: O(1)
            return self.new_tokens
        overlap = (common_blocks(self.chain, chain, start + 1) - start) * block_size
        return max(0, self.new_tokens - overlap)


class InFlight:
    """The requests this router sent, by key and by replica: a decision reads only its
    candidates' own (a pass over every request in flight cost ~2 ms a decision at 1,000
    replicas). Both maps hold the same records; only these methods change them."""

    def __init__(self) -> None:
        self._by_key: dict[int, Routed] = {}
        self._by_worker: dict[str, dict[int, Routed]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_key)

    def __getitem__(self, key: int) -> Routed:
        return self._by_key[key]

    def get(self, key: int) -> Routed | None:
        return self._by_key.get(key)

    def values(self) -> Iterable[Routed]:
        return self._by_key.values()

    def on(self, worker: str) -> Mapping[int, Routed]:
        """The requests in flight on ``worker``, by key (do not mutate)."""
        return self._by_worker.get(worker, _NONE_ROUTED)

    def by_worker(self) -> ItemsView[str, dict[int, Routed]]:
        """(replica, its requests in flight by key) for every replica with some (do not
        mutate)."""
        return self._by_worker.items()

    def add(self, key: int, routed: Routed) -> None:
        self.pop(key)
        self._by_key[key] = routed
        self._by_worker.setdefault(routed.worker, {})[key] = routed

    def pop(self, key: int) -> Routed | None:
        routed = self._by_key.pop(key, None)
        if routed is not None:
            on = self._by_worker[routed.worker]
            del on[key]
            if not on:
                del self._by_worker[routed.worker]
        return routed


_NONE_ROUTED: Mapping[int, Routed] = MappingProxyType({})
