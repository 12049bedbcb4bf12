"""Which LoRA adapters each worker holds in its batch slots, as one router sees them, and what a
request for an adapter pays where it is missing.

A worker reports its slots through Serve's ``record_routing_stats`` (:class:`SlotReport`: the
adapters, least recently used first, their number, its smoothed load time). A router adds what
it sent the worker since that report, which the worker loads as it admits them, so a burst for
one adapter converges on the worker that took the first request instead of loading it
everywhere. A send just before a report may not have reached the worker when the report was
taken, so a report that lacks it overrules it only once ``_SETTLE_S`` have passed since the send.
Pure: no Ray, no I/O.

Price of a request for adapter ``a`` on worker ``w`` (seconds, added to the cost model's):

- ``0`` where ``a`` is in ``w``'s slots;
- ``w``'s measured load time where every slot is taken, at least ``adapter_miss_s``: the load,
  the adapter it evicts (whose requests then pay it), and the wait for a slot while running
  requests hold them all;
- the load time where a slot is free, at least half ``adapter_miss_s``: it evicts nothing, but
  takes a slot another adapter could use, so each adapter keeps to the workers that hold it
  rather than spreading over every free slot (on a CPU worker a load itself costs nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

REPORT_KEY = "loras"  # its key in the routing stats
_SENT_TTL_S = 30.0  # a send the worker has not reported by then is forgotten
_MAX_SENT = 64  # per worker
_SETTLE_S = 5.0  # a report this long after a send that lacks the adapter means it was evicted


@dataclass(frozen=True)
class SlotReport:
    """A worker's batch slots, as it reports them."""

    resident: tuple[str, ...]  # adapter identities, least recently used first
    max_loras: int
    load_s: float  # smoothed seconds a slot load takes there
    at: float  # when it was taken (time.time())

    def stats(self) -> dict[str, Any]:
        """Its place in the routing stats."""
        return {REPORT_KEY: {"resident": list(self.resident), "max_loras": self.max_loras,
                             "load_s": self.load_s, "at": self.at}}

    @classmethod
    def of(cls, stats: Mapping[str, Any]) -> SlotReport | None:
        """The report in a replica's routing stats; None when absent or malformed."""
        raw = stats.get(REPORT_KEY)
        if not isinstance(raw, Mapping):
            return None
        try:
            report = cls(tuple(str(i) for i in raw["resident"]), int(raw["max_loras"]),
                         float(raw["load_s"]), float(raw["at"]))
        except (KeyError, TypeError, ValueError):
            return None
        return report if report.max_loras >= 1 else None


class AdapterSlots:
    """One router's view of every worker's slots: the last reports plus its own sends."""

    def __init__(self) -> None:
        self.sent: dict[str, list[tuple[float, str]]] = {}  # worker -> (when, identity)

    def note(self, worker: str, adapter: str, now: float) -> None:
        """This router sent a request for ``adapter`` to ``worker``."""
        sent = self.sent.setdefault(worker, [])
        sent.append((now, adapter))
        if len(sent) > _MAX_SENT or now - sent[0][0] > _SENT_TTL_S:
            self.sent[worker] = [(t, a) for t, a in sent[-_MAX_SENT:] if now - t <= _SENT_TTL_S]

    def resident(self, worker: str, report: SlotReport | None, now: float) -> list[str]:
        """The adapters ``worker`` holds once what this router sent since ``report`` is loaded,
        or sent so shortly before it that it may still have been on its way: the most recently
        used ``max_loras`` of them (one slot when it never reported)."""
        since = report.at if report is not None else float("-inf")
        order = list(report.resident) if report is not None else []
        for t, adapter in self.sent.get(worker, ()):
            if now - t > _SENT_TTL_S:
                continue
            if t > since:
                if adapter in order:
                    order.remove(adapter)
                order.append(adapter)
            elif since - t < _SETTLE_S and adapter not in order:
                order.append(adapter)
        return order[-(report.max_loras if report is not None else 1):]

    def prices(self, adapter: str, workers: Sequence[tuple[str, Mapping[str, Any]]], now: float,
               miss_s: float) -> list[float]:
        """Per worker (its key and routing stats), the seconds a request for ``adapter`` pays
        there (see the module docstring)."""
        out = []
        for worker, stats in workers:
            report = SlotReport.of(stats)
            held = self.resident(worker, report, now)
            if adapter in held:
                out.append(0.0)
                continue
            load_s = report.load_s if report is not None else 0.0
            full = len(held) >= (report.max_loras if report is not None else 1)
            out.append(max(load_s, miss_s if full else miss_s / 2))
        return out
