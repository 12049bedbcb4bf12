"""Whether a router may ask the index now: the workers' compatibility (block size, model
fingerprint) and the fail-open backoff after a failed lookup. No I/O: the caller runs the checks
and reports what happened."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prefixserve.router.decision_types import Candidate
from prefixserve.router.index import WorkerInfo
from prefixserve.router.router_settings import RouterSettings

logger = logging.getLogger("ray.serve")


class IndexGate:
    """One router's view of whether the index can be used."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.fingerprint = settings.fingerprint  # None until adopted from the workers
        self.compatible: bool | None = None  # None until the first check could run
        self.index_down_until = 0.0
        self.next_check = 0.0

    def usable(self, now: float) -> bool:
        """Whether the index may be used now (on, compatible, not in fail-open backoff)."""
        return bool(self.settings.prefix_routing and self.compatible
                    and now >= self.index_down_until)

    def lookup_blocked(self, now: float) -> str | None:
        """Why a lookup must not be tried now (the fail-open reason), or None."""
        if not self.compatible:
            return "unchecked" if self.compatible is None else "incompatible"
        if now < self.index_down_until:
            return "backoff"
        return None

    def lookup_failed(self, now: float) -> None:
        """Route by load only for ``failopen_backoff_s``: a slow index is not asked again."""
        self.index_down_until = now + self.settings.failopen_backoff_s

    def check_due(self, now: float) -> bool:
        """Whether a workers check is due; if so, the next one is scheduled from now."""
        if now < self.next_check:
            return False
        self.next_check = now + self.settings.check_interval_s
        return True

    def check_postponed(self, now: float) -> None:
        """The check could not run (index unavailable, no worker yet): try again soon."""
        self.next_check = now + self.settings.failopen_backoff_s

    def check_workers(
        self, workers: Sequence[WorkerInfo], candidates: Sequence[Candidate], now: float
    ) -> None:
        """Block size and fingerprint must match the workers', or prefix routing is off: a
        chain hashed differently would never match and would pin traffic by accident."""
        reported = {(w.replica_id, w.block_size, w.fingerprint) for w in workers}
        for candidate in candidates:
            stats = candidate.routing_stats
            if "block_size" in stats and "fingerprint" in stats:
                reported.add((candidate.key, stats["block_size"], stats["fingerprint"]))
        if not reported:  # no worker registered yet: ask again soon
            self.check_postponed(now)
            return
        if self.fingerprint is None:
            fingerprints = {fp for _, _, fp in reported}
            if len(fingerprints) == 1:
                self.fingerprint = fingerprints.pop()
        block_size, model = self.settings.block_size, self.settings.model
        bad = [r for r in reported if r[1] != block_size or r[2] != self.fingerprint]
        if bad:
            logger.error(
                "PREFIX ROUTING DISABLED for model %r: router uses block_size=%d "
                "fingerprint=%r but workers report %s. Fix the configuration so both agree.",
                model, block_size, self.fingerprint, sorted(bad),
            )
            self.compatible = False
            return
        if not self.compatible:
            logger.info(
                "prefix routing on for model %r: block_size=%d fingerprint=%s (%d workers)",
                model, block_size, self.fingerprint, len({r[0] for r in reported}),
            )
        self.compatible = True
