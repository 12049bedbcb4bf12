"""`prefixserve serve`, as a user runs it: a real process starts Ray, a private Redis and the
application, prints its "ready" line only once /ready says every worker answers, and stops
cleanly on Ctrl-C."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from prefixserve.cluster.local_redis import free_port
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.cluster

START_TIMEOUT_S = 240


def test_serve_prints_ready_once_every_worker_answers() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixserve.cluster", "serve", "--model", BUILTIN_MODEL_NAME,
         "--num-workers", "2", "--cpus-per-worker", "0.5", "--port", str(port),
         "--max-model-len", "128", "--num-blocks", "32", "--no-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = _wait_for_line(proc, "prefixserve: ready:")
        assert f"http://127.0.0.1:{port}/v1" in line
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=30)
        assert ready.status_code == 200
        assert list(ready.json()["workers"].values()) == ["ready", "ready"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_line(proc: subprocess.Popen[str], marker: str) -> str:
    """The first output line holding `marker`, within START_TIMEOUT_S.

    A thread reads the pipe so that the deadline holds even when no line comes; Ray's log
    thread writes worker output to the same pipe, so the marker is looked for anywhere in a line.
    """
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            lines.put(text)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            text = lines.get(timeout=left)
        except queue.Empty:
            break
        if text is None:
            pytest.fail(f"exited {proc.wait()} before {marker!r}:\n" + "".join(seen[-30:]))
        seen.append(text)
        if marker in text:
            return text
    pytest.fail(f"no {marker!r} within {START_TIMEOUT_S} s:\n" + "".join(seen[-30:]))
