"""The on-disk cache a node's processes share (converted GGUFs, the built-in model), and the one
way directories appear in it: complete, or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("PREFIXSERVE_CACHE") or Path.home() / ".cache" / "prefixserve")


def cached_directory(final: Path, write: Callable[[Path], None]) -> Path:
    """`final`, filled by `write(folder)` first if absent: written into a temporary folder
    beside it and renamed into place, so it only ever appears complete and racing processes
    (workers starting together on one node) are safe."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
