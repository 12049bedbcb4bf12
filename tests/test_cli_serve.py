"""`prefixserve serve`, as a user runs it: a real process starts Ray, a private Redis and the
application, prints its "ready" line only once /ready says every worker answers, and stops
cleanly on Ctrl-C or a supervisor's SIGTERM, its private Redis with it."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from prefixserve.cluster.local_redis import free_port
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.cluster

START_TIMEOUT_S = 240


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_prints_ready_once_every_worker_answers(stop: signal.Signals) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixserve.cluster", "serve", "--model", BUILTIN_MODEL_NAME,
         "--num-workers", "2", "--cpus-per-worker", "0.5", "--port", str(port),
         "--max-model-len", "128", "--num-blocks", "32", "--no-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out = Output(proc)
        redis_url = out.until("started a private Redis").split()[-1]
        redis_port = urlsplit(redis_url).port
        line = out.until("prefixserve: ready:")
        assert f"http://127.0.0.1:{port}/v1" in line
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=30)
        assert ready.status_code == 200
        assert list(ready.json()["workers"].values()) == ["ready", "ready"]
        proc.send_signal(stop)
        assert proc.wait(timeout=120) == 0
        with pytest.raises(ConnectionRefusedError):  # the private Redis went with it
            socket.create_connection(("127.0.0.1", redis_port), timeout=5).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Output:
    """The process's output lines, read on a thread so that a deadline holds even when no line
    comes; Ray's log thread writes worker output to the same pipe, so a marker is looked for
    anywhere in a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            self.lines.put(text)
        self.lines.put(None)

    def until(self, marker: str) -> str:
        """The next line holding `marker`, within START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                text = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if text is None:
                pytest.fail(f"exited {self.proc.wait()} before {marker!r}:\n"
                            + "".join(self.seen[-30:]))
            self.seen.append(text)
            if marker in text:
                return text
        pytest.fail(f"no {marker!r} within {START_TIMEOUT_S} s:\n" + "".join(self.seen[-30:]))
