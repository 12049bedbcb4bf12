"""Connections to the index's Redis: set up off the caller's deadline, errors made readable.

Setting a connection up (TCP, TLS, AUTH: several round trips) is bounded by ``connect_timeout_s``
and not by the deadline of the call that needed it (:class:`_SetupOffDeadline`), so a Redis that
takes longer to connect to than a lookup may take still serves lookups once connected. Every
failure becomes :class:`router.index.IndexUnavailable` with Redis' reason and the password masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from contextvars import ContextVar
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ConnectionError,
    RedisError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefixserve.router.index import IndexUnavailable

log = logging.getLogger(__name__)

# The deadline of the index call running in this task (3.11+: asyncio.timeout), with its
# length, so that a connection set up for it can take the setup out of it.
CALL_DEADLINE: ContextVar[tuple[Any, float] | None] = ContextVar("index_call", default=None)
_SETTING_UP: ContextVar[bool] = ContextVar("index_setting_up", default=False)


class _SetupOffDeadline:
    """Mixed into redis-py's connection classes: setting a connection up is not a call's work.

    The setup (TCP, TLS, AUTH/HELLO) runs as a task of its own, bounded by
    ``socket_connect_timeout`` (``connect_timeout_s``); the index call that needs it waits with
    its deadline paused and gets its whole deadline for the command once connected. A caller
    that gives up anyway (the router's own cap) leaves the setup running, so the connection is
    ready for the next call instead of being torn down mid-handshake every time.
    """

    _setup: asyncio.Task | None = None
    _shared_tls: Any = None  # per client class: see _off_deadline

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # redis-py builds a TLS context per connection; ssl.create_default_context() loads
        # the system CAs, ~10-50 ms that block the event loop and so every call in flight.
        # A client's connections have the same TLS settings: they share the first one's.
        tls = getattr(self, "ssl_context", None)
        if tls is not None:
            cls = type(self)
            if cls._shared_tls is None:
                cls._shared_tls = tls
            self.ssl_context = cls._shared_tls

    async def connect(self) -> None:
        if self.is_connected:
            return
        task = self._setup
        if task is None or task.done():
            task = self._setup = asyncio.ensure_future(self._set_up())
            task.add_done_callback(_retrieve)
        call = CALL_DEADLINE.get()
        if call is not None:
            _reschedule(call[0], None)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():  # our caller gave up; the setup goes on for the next one
                raise
            current = asyncio.current_task()
            if current is not None and getattr(current, "cancelling", lambda: 0)():
                raise  # our caller is being cancelled too (a loop shutting down): it ends
            raise ConnectionError("the client closed while connecting") from None
        finally:
            if call is not None:
                _reschedule(call[0], asyncio.get_running_loop().time() + call[1])

    async def _set_up(self) -> None:
        _SETTING_UP.set(True)  # this task's own context: see disconnect()
        CALL_DEADLINE.set(None)
        try:
            await asyncio.wait_for(super().connect(), self.socket_connect_timeout)
        except BaseException as exc:
            # Cut off mid-handshake, redis-py would keep the socket as if connected and read
            # the handshake's late replies as the next command's.
            await self.disconnect()
            if isinstance(exc, asyncio.TimeoutError):
                raise RedisTimeoutError("Timeout connecting to server") from None
            raise

    async def disconnect(self, *args: Any, **kwargs: Any) -> None:
        """Also stops a setup in flight (the client is closing), unless the setup itself is
        cleaning up after a failed attempt."""
        task = self._setup
        if task is not None and not task.done() and not _SETTING_UP.get():
            task.cancel()
        await super().disconnect(*args, **kwargs)


def _retrieve(task: asyncio.Task) -> None:
    """Marks a setup's failure as seen: when every caller gave up, nobody else looks at it."""
    if not task.cancelled():
        task.exception()


def _reschedule(timeout: Any, when: float | None) -> None:
    # A deadline that already fired cannot move; its cancellation is on its way anyway.
    with contextlib.suppress(RuntimeError):
        timeout.reschedule(when)


def _off_deadline(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` (plain, TLS or Unix socket, as the URL says) with :class:`_SetupOffDeadline`;
    a class per client, so that only one client's connections share a TLS context."""
    return type(f"{base.__name__}SetupOffDeadline", (_SetupOffDeadline, base), {})


def connect(url: str, socket_timeout_s: float, connect_timeout_s: float) -> Redis | RedisCluster:
    """A client for ``url``; ``?cluster=true`` in the URL selects the Redis Cluster client.

    A model's keys share one hash tag, so each script runs on the one node owning its slot.
    The cluster client builds its own connections: there, setting one up still counts
    against the call that needed it (within ``connect_timeout_s`` at most), and
    ``socket_timeout_s`` bounds each of its reads and writes. The single-node client has no
    read or write timeout of its own: every call already runs under its caller's deadline
    (RedisPrefixIndex._eval, check_redis), and redis-py bounds each write with ``wait_for``,
    a task per command (about 60 of a script call's 200 us of client CPU here).
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    cluster = any(k == "cluster" and v.lower() in ("1", "true", "yes") for k, v in query)
    url = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k != "cluster"])))
    if not parts.netloc:  # `unix:///x` comes back as `unix:/x`, which redis-py >= 8.2 refuses
        url = f"{parts.scheme}://{url.removeprefix(parts.scheme + ':')}"
    options: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout_s,
        # No retries inside redis-py: RedisPrefixIndex._eval retries a dead connection itself,
        # so that every reconnect goes through _SetupOffDeadline.connect.
        "retry": Retry(NoBackoff(), 0),
    }
    if cluster:
        return RedisCluster.from_url(url, socket_timeout=socket_timeout_s, **options)
    options.update(health_check_interval=0, **parse_url(url))  # the URL's options win
    options["connection_class"] = _off_deadline(options.get("connection_class", Connection))
    return Redis.from_pool(ConnectionPool(**options))


_QUERY_PASSWORD = re.compile(r"(^|[&;])(password=)[^&;]*", re.IGNORECASE)


def safe_url(url: str) -> str:
    """``url`` with any password replaced by ``***``: fit for logs and error messages.

    redis-py takes the password from the userinfo or from a ``?password=`` query parameter;
    both are masked, the rest of the URL is left as written.
    """
    parts = urlsplit(url)
    query = _QUERY_PASSWORD.sub(r"\1\2***", parts.query)
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    if query == parts.query and netloc == parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def unavailable(exc: BaseException, url: str) -> IndexUnavailable:
    """Redis' failure in words an operator can act on (wrong password, TLS), password masked."""
    where = safe_url(url)
    if isinstance(exc, AuthenticationError | AuthenticationWrongNumberOfArgsError):
        if urlsplit(url).password is None:
            reason = "requires a password and the URL has none"
        else:
            reason = f"rejected the password ({exc})"
        return IndexUnavailable(
            f"Redis at {where} {reason}: use redis://:PASSWORD@host:port "
            f"(or redis://USER:PASSWORD@host:port)"
        )
    plain = url.startswith("redis://")
    hint = "is it up? a TLS port needs rediss://" if plain else "is it up, with TLS?"
    return IndexUnavailable(
        f"cannot use Redis at {where}: {type(exc).__name__}: {str(exc) or 'no reply'} ({hint})"
    )


async def check_redis(url: str, timeout_s: float = 5.0) -> None:
    """One PING, so that a deployment fails at start-up with the reason (wrong password, TLS,
    unreachable) instead of serving with prefix routing silently off."""
    client = connect(url, timeout_s, timeout_s)
    try:
        await asyncio.wait_for(client.ping(), timeout_s)
    except (RedisError, OSError, asyncio.TimeoutError) as exc:
        raise unavailable(exc, url) from None
    finally:
        await client.aclose()
