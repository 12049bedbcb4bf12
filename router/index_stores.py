"""The index stores by URL scheme, and :func:`open_index`, which opens a model's index in one.

A new store is one module with a class taking ``(url, model, *, deadline_s, settings)`` plus one
entry in :data:`INDEX_STORES`. Here rather than in :mod:`router.index`, the protocol every store
and the sharded index implement: opening may wrap stores in a :class:`ShardedPrefixIndex`.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from prefixserve.router.index import IndexSettings, PrefixIndex
from prefixserve.router.registry import Registry
from prefixserve.router.sharded_index import ShardedPrefixIndex

# URL scheme -> "module:class" of the store serving it (imported on first use, so a process
# only loads the client library of the store it uses).
INDEX_STORES: Registry[str] = Registry(
    "prefix index store",
    dict.fromkeys(("redis", "rediss", "unix"), "prefixserve.router.redis_index:RedisPrefixIndex"),
    unknown=lambda scheme, known: ValueError(
        f"no prefix index store serves {scheme or 'scheme-less'} URLs "
        f"({', '.join(f'{s}://' for s in known)})"),
)


def open_index(
    url: str,
    model: str,
    *,
    deadline_s: float,
    settings: IndexSettings | None = None,
) -> PrefixIndex:
    """The index of ``model`` in the store ``url`` names (chosen by its scheme).

    ``deadline_s`` bounds the caller's frequent calls (lookups for a router, events for a
    worker); ``settings`` holds the rest (default: :class:`IndexSettings`).
    """
    module, _, name = INDEX_STORES.lookup(urlsplit(url).scheme).partition(":")
    store = getattr(importlib.import_module(module), name)
    settings = settings or IndexSettings()
    if settings.shards == 1:
        return store(url, model, deadline_s=deadline_s, settings=settings)
    return ShardedPrefixIndex(
        model, settings, lambda group: store(url, group, deadline_s=deadline_s, settings=settings))
