"""What the tiers share: the media, a load that failed and why, and the tiers' counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from prefixserve.router.events import DEVICE, DISK, HOST

__all__ = ["DEVICE", "DISK", "HOST", "LoadFailed", "TierCounters", "Waiting"]

# Why a block found in a lower tier did not load; each is a miss, recomputed.
LOAD_FAILURES = ("missing", "truncated", "corrupt", "checksum", "layout", "read_error")
# Why a block was not written to disk; it stays wherever else it is.
STORE_SKIPS = ("disk_full", "disk_busy", "write_error", "too_big")


class Waiting(Protocol):
    """What the tiers read of a waiting sequence (``workers.scheduler.Sequence``)."""

    seq_id: str
    loaded_blocks: int
    tiers_checked: bool  # set again to False: the pool had no room for all it found lower down

    @property
    def hashes(self) -> list[bytes]: ...

    @property
    def num_tokens(self) -> int: ...


class LoadFailed(Exception):
    """A lower tier's copy of a block that cannot be used: never loaded, counted by reason."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in LOAD_FAILURES, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class TierCounters:
    """Cumulative, per medium (host, disk) or reason: what Prometheus counters are fed from.

    The engine's own are Counters; a snapshot holds plain dicts (``dataclasses.asdict`` would
    rebuild a Counter from its items, counting the pairs)."""

    offloaded_bytes: dict[str, float] = field(default_factory=Counter)
    offload_s: dict[str, float] = field(default_factory=Counter)
    loaded_bytes: dict[str, float] = field(default_factory=Counter)
    load_s: dict[str, float] = field(default_factory=Counter)
    load_failures: dict[str, float] = field(default_factory=Counter)
    store_skips: dict[str, float] = field(default_factory=Counter)
    host_usage: float = 0.0  # of the host tier's slots in use, when the snapshot was taken

    def snapshot(self, host_usage: float = 0.0) -> TierCounters:
        return TierCounters(*(dict(c) for c in (
            self.offloaded_bytes, self.offload_s, self.loaded_bytes, self.load_s,
            self.load_failures, self.store_skips)), host_usage)
