"""How much CPU the benchmark's own processes and everything else took while a point ran.

`bench compare` runs the cluster (Ray, Serve, the workers, Redis) and the load client inside
its own process tree. On a shared machine other jobs take cores from the workers, and the
ratios between policies move with them: the same command gave 1.0x to 1.9x on this 2-core VM.
Each point therefore reports the cores its own tree used, the cores everything else used, and
the cores the hypervisor gave to other VMs (steal), so a reader can tell a quiet run from a
crowded one. Linux only (``/proc``); elsewhere the figures are left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")


@dataclass(frozen=True)
class CpuSample:
    at: float  # time.monotonic()
    busy: int  # machine-wide busy ticks (user, nice, system, irq, softirq)
    steal: int  # ticks the hypervisor ran other VMs on our virtual CPUs
    own: int  # ticks of the process tree under the root, reaped children included


def machine_ticks(stat_text: str) -> tuple[int, int]:
    """(busy, steal) ticks from the `cpu` line of /proc/stat."""
    fields = stat_text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError("no aggregate cpu line in /proc/stat")
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return user + nice + system + irq + softirq, steal


def process_ticks(stat_text: str) -> tuple[int, int]:
    """(parent pid, utime + stime + cutime + cstime) from one /proc/PID/stat line. The name
    field may hold spaces and parentheses, so fields are counted after its last ')'."""
    fields = stat_text[stat_text.rindex(")") + 2:].split()
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def tree_ticks(processes: dict[int, tuple[int, int]], root: int) -> int:
    """Ticks of `root` and all its descendants; `processes` maps pid -> (ppid, ticks)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += processes.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, ()))
    return total


def _read_processes() -> dict[int, tuple[int, int]]:
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = process_ticks((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):  # it exited while we looked
                continue
    return out


def sample(root: int | None = None) -> CpuSample | None:
    """A reading now; None where /proc is not there to read."""
    try:
        busy, steal = machine_ticks((PROC / "stat").read_text())
    except (OSError, ValueError):
        return None
    own = tree_ticks(_read_processes(), root if root is not None else os.getpid())
    return CpuSample(time.monotonic(), busy, steal, own)


def cpu_figures(before: CpuSample, after: CpuSample,
                ticks_per_s: float = os.sysconf("SC_CLK_TCK")) -> dict[str, float]:
    """Mean cores used between two readings: by the tree, by other processes, stolen."""
    seconds = max(after.at - before.at, 1e-9) * ticks_per_s
    own = (after.own - before.own) / seconds
    busy = (after.busy - before.busy) / seconds
    return {
        "own_cpu_cores": own,
        "other_cpu_cores": max(0.0, busy - own),
        "stolen_cpu_cores": (after.steal - before.steal) / seconds,
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
