"""bench/load/machine.py: the arithmetic on hand-made readings, and real psutil readings with a busy
process inside this process tree and one outside it, and memory held by a child."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from prefixserve.bench.load.machine import (
    CpuSample,
    busy_seconds,
    cpu_figures,
    sample,
    tree,
    tree_usage,
)


def test_busy_seconds_count_busy_states_and_steal_apart() -> None:
    linux = namedtuple("linux", "user nice system idle iowait irq softirq steal guest guest_nice")
    assert busy_seconds(linux(100, 20, 30, 5000, 7, 1, 2, 9, 0, 0)) == (100 + 20 + 30 + 1 + 2, 9)
    mac = namedtuple("mac", "user nice system idle")       # no irq, softirq or steal there
    assert busy_seconds(mac(4.0, 1.0, 2.0, 90.0)) == (7.0, 0.0)


def test_cpu_figures_are_mean_cores_over_the_interval() -> None:
    before = CpuSample(at=10.0, busy=10.0, steal=0.0, own=4.0, own_rss=1 << 30)
    after = CpuSample(at=12.0, busy=13.0, steal=0.4, own=5.5, own_rss=3 << 29)
    figures = cpu_figures(before, after)
    assert figures == pytest.approx({"own_cpu_cores": 0.75, "other_cpu_cores": 0.75,
                                     "stolen_cpu_cores": 0.2, "own_rss_mib": 1536.0})


def test_tree_holds_the_root_and_its_descendants_only(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    waiter = tmp_path / "wait.py"
    waiter.write_text(f"import os,time\n"
                      f"while not os.path.exists({str(stop)!r}): time.sleep(0.05)\n")
    parent = tmp_path / "parent.py"
    parent.write_text(f"import subprocess,sys\nsubprocess.run([sys.executable, {str(waiter)!r}])\n")
    child = subprocess.Popen([sys.executable, str(parent)])
    try:
        for _ in range(200):                       # until the grandchild has started
            pids = [p.pid for p in tree(os.getpid())]
            if len(pids) >= 3:
                break
            time.sleep(0.05)
        assert pids[0] == os.getpid() and child.pid in pids and len(pids) == 3, pids
        below = [p.pid for p in tree(child.pid)]
        assert below[0] == child.pid and len(below) == 2 and os.getpid() not in below
    finally:
        stop.touch()
        child.wait(timeout=10)


def test_a_gone_process_is_skipped_not_fatal() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    procs = tree(os.getpid())
    proc.wait(timeout=10)
    cpu, rss = tree_usage(procs)
    assert cpu > 0 and rss > 0


def test_a_child_holding_memory_is_own_rss(tmp_path: Path) -> None:
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    hold = (f"import os,time\nb = bytearray(256 << 20)\nopen({str(ready)!r}, 'w').close()\n"
            f"while not os.path.exists({str(stop)!r}): time.sleep(0.05)\n")
    base = sample()
    child = subprocess.Popen([sys.executable, "-c", hold])
    try:
        for _ in range(200):
            if ready.exists():
                break
            time.sleep(0.05)
        held = sample()
    finally:
        stop.touch()
        child.wait(timeout=10)
    assert base is not None and held is not None
    assert held.own_rss - base.own_rss > 200 << 20


SPIN = "import os,time\nwhile not os.path.exists({stop!r}): pass\n"


def _reading_while(tmp_path: Path, outside: bool) -> tuple[dict[str, float], float]:
    """Figures over 1.2 s while a spinner runs, and the cores the spinner itself got then (on
    a crowded machine it gets less than one, so the figures are checked against it)."""
    stop = tmp_path / "stop"
    script = tmp_path / "spin.py"
    script.write_text(SPIN.format(stop=str(stop)))
    if outside:
        # The shell starts the spinner in the background and exits: the spinner is re-parented
        # away from this process, as an unrelated job on the machine would be.
        subprocess.run(["sh", "-c", f"'{sys.executable}' '{script}' >/dev/null 2>&1 &"],
                       check=True)
    else:
        child = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(0.3)
        (spinner,) = [p for p in psutil.process_iter(["cmdline"])
                      if str(script) in (p.info["cmdline"] or [])]
        spun = sum(spinner.cpu_times()[:2])
        before = sample()
        time.sleep(1.2)
        after = sample()
        spun = sum(spinner.cpu_times()[:2]) - spun
    finally:
        stop.touch()
        if not outside:
            child.wait(timeout=10)
    assert before is not None and after is not None
    return cpu_figures(before, after), spun / (after.at - before.at)


def test_a_busy_child_is_own_cpu(tmp_path: Path) -> None:
    figures, spinner = _reading_while(tmp_path, outside=False)
    assert spinner > 0.05, spinner
    assert figures["own_cpu_cores"] >= 0.9 * spinner, (figures, spinner)


def test_a_busy_process_outside_the_tree_is_other_cpu(tmp_path: Path) -> None:
    figures, spinner = _reading_while(tmp_path, outside=True)
    assert spinner > 0.05, spinner
    assert figures["other_cpu_cores"] >= 0.9 * spinner, (figures, spinner)
    assert figures["own_cpu_cores"] < 0.5 * spinner + 0.05, (figures, spinner)
