"""bench/micro/redis_time.py against a real redis-server: the scripts' names, the SLOWLOG switched
on and back, and only the chosen scripts' times read, oldest first."""

from __future__ import annotations

import pytest
import redis

from prefixserve.bench.micro.redis_time import (
    SLOWLOG_MAX_LEN,
    script_sha,
    slowlog_ms,
    slowlog_on,
    slowlog_restore,
)
from prefixserve.router import redis_scripts

pytestmark = pytest.mark.cluster

# busy inside Redis for ARGV[1] microseconds
SLOW = """
local function now() local t = redis.call('TIME') return t[1] * 1000000 + t[2] end
local start = now()
while now() - start < tonumber(ARGV[1]) do end
return 1
"""


def test_script_sha_is_what_redis_names_the_index_scripts() -> None:
    client = redis.Redis()  # register_script only hashes the source: no connection is made
    for name in ("lookup", "live", "apply"):
        assert script_sha(name) == client.register_script(redis_scripts.source(name)).sha
    assert script_sha("lookup") != script_sha("live")


def test_slowlog_times_only_the_named_scripts_oldest_first(redis_server) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    settings = ("slowlog-log-slower-than", "slowlog-max-len")
    original = {name: raw.config_get(name)[name] for name in settings}
    before = slowlog_on(raw)
    try:
        assert before == original
        assert raw.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"] == "0"
        assert raw.config_get("slowlog-max-len")["slowlog-max-len"] == str(SLOWLOG_MAX_LEN)
        slow = raw.register_script(SLOW)
        quick = raw.register_script("return 0")
        slow(args=[0])
        quick()
        slowlog_ms(raw)  # the first calls' NOSCRIPT replies and SCRIPT LOADs: drained
        slow(args=[3000])
        quick()
        raw.ping()
        slow(args=[200])
        times = slowlog_ms(raw, slow.sha)
        assert len(times) == 2 and times[0] >= 3.0 > times[1] >= 0.2  # the slower one first
        assert slowlog_ms(raw, slow.sha) == []  # read once: the log was emptied
        quick()
        slow(args=[100])
        assert len(slowlog_ms(raw, quick.sha, slow.sha)) == 2
    finally:
        slowlog_restore(raw, before)
    assert {name: raw.config_get(name)[name] for name in settings} == original
    raw.close()
