"""bench/machine.py: /proc parsing on hand-written text, and real readings with a busy process
inside this process tree and one outside it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.machine import (
    CpuSample,
    cpu_figures,
    machine_ticks,
    process_ticks,
    sample,
    tree_ticks,
)

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")


def test_machine_ticks_count_busy_states_and_steal_apart() -> None:
    text = "cpu  100 20 30 5000 7 1 2 9 0 0\ncpu0 50 10 15 2500 3 0 1 4 0 0\n"
    assert machine_ticks(text) == (100 + 20 + 30 + 1 + 2, 9)
    with pytest.raises(ValueError):
        machine_ticks("intr 1 2 3\n")


def test_process_ticks_read_past_a_name_with_spaces_and_parentheses() -> None:
    fields = ["S", "41"] + ["0"] * 9 + ["7", "3", "100", "50"] + ["0"] * 30
    assert process_ticks("1234 (ray::Worker (x) y) " + " ".join(fields)) == (41, 160)


def test_tree_ticks_sum_the_root_and_every_descendant_only() -> None:
    processes = {10: (1, 5), 11: (10, 7), 12: (11, 100), 13: (10, 1), 20: (1, 1000), 21: (20, 3)}
    assert tree_ticks(processes, 10) == 5 + 7 + 100 + 1
    assert tree_ticks(processes, 11) == 107
    assert tree_ticks(processes, 99) == 0


def test_cpu_figures_are_mean_cores_over_the_interval() -> None:
    before = CpuSample(at=10.0, busy=1000, steal=0, own=400)
    after = CpuSample(at=12.0, busy=1300, steal=40, own=550)
    figures = cpu_figures(before, after, ticks_per_s=100)
    assert figures == pytest.approx({"own_cpu_cores": 0.75, "other_cpu_cores": 0.75,
                                     "stolen_cpu_cores": 0.2})


SPIN = "import os,time\nwhile not os.path.exists({stop!r}): pass\n"


def _reading_while(start_spinner, stop: Path) -> dict[str, float]:
    start_spinner()
    try:
        time.sleep(0.3)
        before = sample()
        time.sleep(1.2)
        after = sample()
    finally:
        stop.touch()
    assert before is not None and after is not None
    return cpu_figures(before, after)


def test_a_busy_child_is_own_cpu(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    procs: list[subprocess.Popen] = []
    figures = _reading_while(
        lambda: procs.append(subprocess.Popen([sys.executable, "-c", SPIN.format(stop=str(stop))])),
        stop)
    procs[0].wait(timeout=10)
    assert figures["own_cpu_cores"] > 0.5, figures


def test_a_busy_process_outside_the_tree_is_other_cpu(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    script = tmp_path / "spin.py"
    script.write_text(SPIN.format(stop=str(stop)))
    # The shell starts the spinner in the background and exits: the spinner is re-parented
    # away from this process, as an unrelated job on the machine would be.
    figures = _reading_while(
        lambda: subprocess.run(["sh", "-c", f"'{sys.executable}' '{script}' >/dev/null 2>&1 &"],
                               check=True),
        stop)
    assert figures["other_cpu_cores"] > 0.5, figures
    assert figures["own_cpu_cores"] < 0.5, figures
