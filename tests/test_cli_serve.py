"""`prefixserve serve`, as a user runs it: a real process starts Ray, a private Redis and the
application, prints its "ready" line only once /ready says every worker answers, and stops
cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
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
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        seen: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("prefixserve: ready:"):
                break
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen[-30:])
        else:
            pytest.fail("".join(seen[-30:]))
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
