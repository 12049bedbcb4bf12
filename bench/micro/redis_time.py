"""Redis' own time per index script call, from its SLOWLOG at threshold 0.

Wall time through a client adds the round trip and, on a virtual machine, the wait for Redis and
then the caller to be scheduled again. The SLOWLOG records each command's execution time inside
Redis, with no queueing and no client, so benchmarks can report the work apart from the wait.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from prefixserve.router import redis_scripts

SLOWLOG_MAX_LEN = 200_000


def script_sha(name: str) -> str:
    """The SHA1 Redis names index script ``name`` by (what EVALSHA sends)."""
    return hashlib.sha1(redis_scripts.source(name).encode()).hexdigest()


def slowlog_on(raw: redis.Redis) -> dict[str, str]:
    """Log every command from now on; returns the settings it replaced, for
    :func:`slowlog_restore`."""
    names = ("slowlog-log-slower-than", "slowlog-max-len")
    before = {name: raw.config_get(name)[name] for name in names}
    raw.config_set("slowlog-log-slower-than", 0)
    raw.config_set("slowlog-max-len", SLOWLOG_MAX_LEN)
    raw.slowlog_reset()
    return before


def slowlog_restore(raw: redis.Redis, before: dict[str, str]) -> None:
    for name, value in before.items():
        raw.config_set(name, value)
    raw.slowlog_reset()


def slowlog_ms(raw: redis.Redis, *shas: str) -> list[float]:
    """Server-side durations (ms) of the logged EVALSHAs of the scripts ``shas``, oldest
    first; empties the log."""
    out = []
    for entry in raw.slowlog_get(-1):
        cmd = entry["command"]
        if isinstance(cmd, bytes):
            cmd = cmd.decode(errors="replace")
        if cmd.lower().startswith("evalsha") and any(sha in cmd for sha in shas):
            out.append(entry["duration"] / 1000)
    raw.slowlog_reset()
    return out[::-1]  # the log lists the newest first


@contextmanager
def lookup_clock(url: str | None) -> Iterator[Callable[[], float] | None]:
    """A reader of Redis' own time (ms) running prefix lookups (the index's lookup and
    live-workers scripts) since its last call, through the SLOWLOG of the server at ``url``
    (restored after); None without a URL or where the server refuses CONFIG (a managed Redis)."""
    if url is None:
        yield None
        return
    with redis.Redis.from_url(url) as raw:
        try:
            before = slowlog_on(raw)
        except redis.ResponseError:
            yield None
            return
        shas = (script_sha("lookup"), script_sha("live"))
        try:
            yield lambda: sum(slowlog_ms(raw, *shas))
        finally:
            slowlog_restore(raw, before)
