"""How much CPU the benchmark's own processes and everything else took while a point ran.

`bench compare` runs the cluster (Ray, Serve, the workers, Redis) and the load client inside
its own process tree. On a shared machine other jobs take cores from the workers, and the
ratios between policies move with them: the same command gave 1.0x to 1.9x on this 2-core VM.
Each point therefore reports the cores its own tree used, the cores everything else used, the
cores the hypervisor gave to other VMs (steal, Linux only), and the tree's memory at the end,
so a reader can tell a quiet run from a crowded one. Readings come from psutil.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psutil


def cpu_name() -> str:
    """The CPU's model name, for a benchmark's header (results differ by CPU: AVX2, AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


@dataclass(frozen=True)
class CpuSample:
    at: float  # time.monotonic()
    busy: float  # machine-wide busy CPU seconds (user, nice, system, irq, softirq)
    steal: float  # CPU seconds the hypervisor ran other VMs on our virtual CPUs
    own: float  # CPU seconds of the process tree under the root, reaped children included
    own_rss: int  # bytes resident in the tree's processes (summed: shared pages count twice)


def busy_seconds(times: Any) -> tuple[float, float]:
    """(busy, steal) from `psutil.cpu_times()`; fields a platform lacks count as 0."""
    busy = sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))
    return busy, getattr(times, "steal", 0.0)


def tree(root: int) -> list[psutil.Process]:
    """`root` and all its descendants (by parent pid, as they are now)."""
    proc = psutil.Process(root)
    return [proc, *proc.children(recursive=True)]


def tree_usage(processes: list[psutil.Process]) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) summed over the processes; CPU includes each one's reaped
    children (cutime, cstime), so a child that exited during the point still counts."""
    cpu, rss = 0.0, 0
    for proc in processes:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
                rss += proc.memory_info().rss
        except psutil.Error:  # it exited (or became unreadable) while we looked
            continue
    return cpu, rss


def sample(root: int | None = None) -> CpuSample | None:
    """A reading now; None where the root process cannot be read."""
    busy, steal = busy_seconds(psutil.cpu_times())
    try:
        own, rss = tree_usage(tree(root if root is not None else os.getpid()))
    except psutil.Error:
        return None
    return CpuSample(time.monotonic(), busy, steal, own, rss)


def cpu_figures(before: CpuSample, after: CpuSample) -> dict[str, float]:
    """Mean cores used between two readings (by the tree, by other processes, stolen) and
    the tree's RSS at the second."""
    seconds = max(after.at - before.at, 1e-9)
    own = (after.own - before.own) / seconds
    busy = (after.busy - before.busy) / seconds
    return {
        "own_cpu_cores": own,
        "other_cpu_cores": max(0.0, busy - own),
        "stolen_cpu_cores": (after.steal - before.steal) / seconds,
        "own_rss_mib": after.own_rss / 2**20,
    }


def cpu_measure() -> Callable[[], Awaitable[Callable[[], Awaitable[dict[str, Any]]]]]:
    """For `run_sweep(measures=...)`: a reading before a point and one after it."""

    async def start() -> Callable[[], Awaitable[dict[str, Any]]]:
        before = sample()

        async def finish() -> dict[str, Any]:
            after = sample()
            return cpu_figures(before, after) if before and after else {}

        return finish

    return start
