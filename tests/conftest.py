"""Shared fixtures. One private redis-server per test module: tests may kill and restart it.

Two tiers: tests marked `cluster` (Ray/Serve, a redis-server) and the unit tier, everything
else (`make test-unit`). The hooks below keep the split honest: a unit-tier test that asks for a
redis-server fixture, starts a `LocalRedis`, or starts Ray fails at once with a clear error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import ray.cluster_utils

from prefixserve.cluster.local_redis import LocalRedis, free_port

# Exact parity with transformers is an fp32 matter: dtype auto stays float32 on every CPU, in this
# process and the Ray workers it starts (workers/cpu_dtype.py).
os.environ.setdefault("PREFIXSERVE_CPU_DTYPE", "float32")

TLS_PASSWORD = "tls-pw"

# The unit-tier guard. It is set up in the setup hook rather than in an autouse fixture: pytest
# builds module-scoped fixtures (redis_server, a module's Serve app) before any function-scoped
# autouse fixture, so only a hook sees them start.
CLUSTER_FIXTURES = ("redis_server", "tls_redis")
_GUARD = pytest.StashKey[pytest.MonkeyPatch]()


def _refuse(what: str, test: str):
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{test} {what} but is not marked `cluster`: mark it (or its module) "
                           "with pytest.mark.cluster, or keep it off servers")
    return refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if item.get_closest_marker("cluster") is None:
        used = [name for name in CLUSTER_FIXTURES if name in getattr(item, "fixturenames", ())]
        if used:
            pytest.fail(f"{item.nodeid} uses {', '.join(used)} but is not marked `cluster`: mark "
                        "it (or its module) with pytest.mark.cluster", pytrace=False)
        guard = item.stash[_GUARD] = pytest.MonkeyPatch()
        guard.setattr(LocalRedis, "start", _refuse("starts a redis-server", item.nodeid))
        guard.setattr(ray, "init", _refuse("starts Ray (ray.init)", item.nodeid))
        guard.setattr(ray.cluster_utils.Cluster, "__init__",
                      _refuse("starts a Ray cluster", item.nodeid))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    try:
        return (yield)
    finally:
        guard = item.stash.get(_GUARD, None)
        if guard is not None:
            guard.undo()


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """With ``PREFIXSERVE_FAST_EXIT=1`` (``make test``), leave with pytest's own status once it
    has reported, skipping interpreter finalization: with Ray's and torch's native threads loaded
    it sometimes segfaults after every test passed (exit 139, no Python frame to blame), which
    would fail a green run. Off by default, so in-process runners (mutmut) keep their process."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or os.environ.get("PREFIXSERVE_FAST_EXIT") != "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.close()


def reverse_index(raw, key: str | bytes) -> bytes:
    """A worker's reverse index (key ``r:<id>``) as one blob of block keys, in order: its sealed
    segments (hash ``r:<id>:s``, fields 0, 1, ...) then its tail (the string ``r:<id>``), as
    ``router/lua/_reverse.lua`` keeps it."""
    key = key.encode() if isinstance(key, str) else key
    sealed = raw.hgetall(key + b":s")
    return b"".join(sealed[str(i).encode()] for i in range(len(sealed))) + (raw.get(key) or b"")


@dataclass
class TlsRedis:
    server: LocalRedis
    tls_port: int
    ca: str  # the throwaway CA's certificate

    @property
    def url(self) -> str:
        """TLS, password and CA check: what a production deployment would pass."""
        return (f"rediss://:{TLS_PASSWORD}@127.0.0.1:{self.tls_port}/0"
                f"?ssl_ca_certs={self.ca}&ssl_cert_reqs=required")

    @property
    def plaintext_url(self) -> str:
        """The right password, but no TLS: the TLS port refuses it."""
        return f"redis://:{TLS_PASSWORD}@127.0.0.1:{self.tls_port}/0"


def make_tls_files(directory: Path) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "srv.key", directory / "srv.csr", directory / "srv.crt"
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args: object) -> None:
        subprocess.run([str(a) for a in args], check=True, capture_output=True)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=prefixserve-test-ca", "-keyout", ca_key, "-out", ca_crt)
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", key, "-out", csr)
    run("openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key,
        "-CAcreateserial", "-days", "1", "-extfile", ext, "-out", crt)
    return str(ca_crt), str(crt), str(key)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    """A private redis-server with a password and a TLS port (self-signed CA made here)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    ca, crt, key = make_tls_files(tmp_path_factory.mktemp("tls"))
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", crt, "--tls-key-file", key,
            "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
    try:
        server = LocalRedis(password=TLS_PASSWORD, extra_args=args).start()
    except RuntimeError:
        pytest.skip("this redis-server was built without TLS")
    try:
        yield TlsRedis(server, tls_port, ca)
    finally:
        server.close()
