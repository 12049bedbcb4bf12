"""The Lua sources of the Redis prefix index, read from ``router/lua/`` (package data).

Each operation is one ``.lua`` file run as one atomic EVALSHA. Code several scripts share
(the Redis clock, the block-set primitives, the epoch check, the result codes) lives once in a
fragment file whose name starts with ``_``; a script pulls one in with a line
``--#include _name.lua``, replaced by the fragment's text (each fragment at most once per
script, so fragments may include each other).
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

_INCLUDE = re.compile(r"--#include (_[a-z_]+\.lua)")

SCRIPTS = (
    "register", "heartbeat", "apply", "resync_begin", "resync_chunk", "resync_commit",
    "gc_mark", "gc_chunk", "lookup", "predict", "live", "log_head",
)


def _read(name: str) -> str:
    return files("prefixserve.router").joinpath("lua", name).read_text(encoding="utf-8")


def _expand(name: str, included: set[str]) -> str:
    parts = []
    for line in _read(name).splitlines(keepends=True):
        match = _INCLUDE.fullmatch(line.rstrip("\n"))
        if match is None:
            parts.append(line)
        elif match[1] not in included:
            included.add(match[1])
            parts.append(_expand(match[1], included))
    return "".join(parts)


@cache
def source(script: str) -> str:
    """The full Lua text of ``script`` (a name in :data:`SCRIPTS`), fragments included."""
    if script not in SCRIPTS:
        raise ValueError(f"no index script {script!r}; known: {', '.join(SCRIPTS)}")
    return _expand(f"{script}.lua", set())
