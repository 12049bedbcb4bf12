"""The disk tier: one worker's folder of block files, capped in bytes, LRU, read and written off
the engine thread, and found again by the next worker of the same model (a warm restart).

Folder: ``<kv_disk_dir>/<layout key>/worker-<k>/``. The layout key (``disk_format.layout_key``)
names the model, block size, dtype and tensor layout, so a folder of another model or layout is
never opened (one log line says it is there). A file holds K and V position-major whatever the
pool's order within a block (``attention.layouts``), so workers that chose differently share
files.
``worker-<k>`` is the first one whose lock file this process can lock: workers of one node
share the directory without sharing files, and a worker that replaces a dead one (whose lock
died with it) takes over its blocks.

Threads: one writer (writes, then deletes, in submission order) and one reader. The engine
thread keeps the bookkeeping (``files``, ``pending``) and learns of finished writes in `reap`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from prefixserve.workers.attention import layouts
from prefixserve.workers.kv_tiers.base import LoadFailed
from prefixserve.workers.kv_tiers.disk_format import (
    HEADER,
    TMP_SUFFIX,
    check_header,
    file_name,
    hash_of,
    read_block,
    write_block,
)

log = logging.getLogger(__name__)

LAYOUT_FILE = "layout.json"
MAX_WORKER_FOLDERS = 256
MAX_PENDING_WRITES = 256  # blocks queued for the writer; past it a block is not written
DEFAULT_MIN_FREE_BYTES = 1 << 30  # the tier writes nothing while the disk has less free


def claim_folder(root: Path, key: bytes, layout: dict) -> tuple[Path, int]:
    """This worker's folder under `root` for the layout `key`, and the descriptor holding its
    lock (held until the process ends)."""
    model_dir = root / key.hex()
    model_dir.mkdir(parents=True, exist_ok=True)
    layout_file = model_dir / LAYOUT_FILE
    if not layout_file.is_file():
        tmp = model_dir / f".{LAYOUT_FILE}.{os.getpid()}{TMP_SUFFIX}"
        tmp.write_text(json.dumps(layout, indent=1, sort_keys=True))
        os.replace(tmp, layout_file)
    others = [p.name for p in root.iterdir()
              if p.is_dir() and p != model_dir and (p / LAYOUT_FILE).is_file()]
    if others:
        log.info("KV disk tier: ignoring %d folder(s) of other models or layouts in %s: %s",
                 len(others), root, ", ".join(sorted(others)))
    for k in range(MAX_WORKER_FOLDERS):
        folder = model_dir / f"worker-{k}"
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return folder, fd
    raise RuntimeError(f"all {MAX_WORKER_FOLDERS} worker folders under {model_dir} are in use")


class DiskTier:
    def __init__(self, root: Path, key: bytes, layout: dict, block_shape: Sequence[int],
                 dtype: torch.dtype, capacity_bytes: int,
                 min_free_bytes: int = DEFAULT_MIN_FREE_BYTES, order: str = "rows") -> None:
        """`order`: the pool's order of K and V within a block; a file holds them
        position-major whatever it is (`attention.layouts`), converted on the writer and reader
        threads."""
        self.key = key
        self.order = order
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = int(np.prod(block_shape)) * torch.empty(0, dtype=dtype).element_size()
        self.file_bytes = HEADER.size + self.block_bytes
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.folder, self._lock_fd = claim_folder(Path(root), key, layout)
        self.files: OrderedDict[bytes, int] = OrderedDict()  # written, least recently used first
        self.pending: set[bytes] = set()  # queued for the writer
        self.used_bytes = 0  # files and pending writes
        self.evicted: list[bytes] = []  # dropped for room since the owner last looked
        self._done: deque[tuple[bytes, OSError | None]] = deque()  # from the writer thread
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.files or block_hash in self.pending

    def __len__(self) -> int:
        return len(self.files) + len(self.pending)

    def readable(self, block_hash: bytes) -> bool:
        """Written and not yet dropped: a lookup may load it."""
        return block_hash in self.files

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self.files:
            self.files.move_to_end(block_hash)

    # ----------------------------------------------------------------- the folder at start

    def scan(self) -> list[bytes]:
        """Take over what the folder holds (a warm restart): blocks whose header fits this
        layout, least recently written evicted first. Partial writes and unreadable files are
        deleted; a file of another layout is left alone and never loaded."""
        found: list[tuple[int, bytes, int]] = []
        removed = foreign = 0
        for entry in os.scandir(self.folder):
            if entry.name.endswith(TMP_SUFFIX):  # a write cut short (the writer was killed)
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
                continue
            block_hash = hash_of(entry.name)
            if block_hash is None:
                continue
            try:
                stat = entry.stat()
                size = stat.st_size
                with open(entry.path, "rb") as f:
                    raw = f.read(HEADER.size)
                if check_header(raw, self.key, block_hash, size) != self.block_bytes:
                    raise LoadFailed("layout", "payload size")
            except LoadFailed as exc:
                if exc.reason == "layout":
                    foreign += 1
                else:
                    Path(entry.path).unlink(missing_ok=True)
                    removed += 1
                continue
            except OSError:
                continue
            found.append((stat.st_mtime_ns, block_hash, size))
        for _, block_hash, size in sorted(found):
            self.files[block_hash] = size
            self.used_bytes += size
        self._make_room(0)
        self.evicted.clear()  # never announced: nothing to take back
        log.info("KV disk tier: %s holds %d blocks of this model (%.1f MiB); %d unreadable or "
                 "partial files removed, %d of another layout ignored", self.folder,
                 len(self.files), self.used_bytes / 2**20, removed, foreign)
        return list(self.files)

    # ----------------------------------------------------------------- writing

    def store(self, block_hash: bytes, data: torch.Tensor) -> str | None:
        """Queue `data` (the caller's to give away) for writing; None when queued or already
        held (then only touched), else why it is not written (``base.STORE_SKIPS``)."""
        if block_hash in self:
            self.touch(block_hash)
            return None
        if self.file_bytes > self.capacity_bytes:
            return "too_big"
        if len(self.pending) >= MAX_PENDING_WRITES:
            return "disk_busy"
        # The disk's free space before the cap's evictions: a write skipped for want of space
        # must not cost the files it would have evicted (their unlinks free nothing in time).
        try:
            free = shutil.disk_usage(self.folder).free
        except OSError:  # the folder is gone: serving goes on without the tier
            return "write_error"
        if free - self.file_bytes < self.min_free_bytes:
            return "disk_full"
        if not self._make_room(self.file_bytes):
            return "disk_busy"  # pending writes fill the cap
        self.pending.add(block_hash)
        self.used_bytes += self.file_bytes
        self._writer.submit(self._write, block_hash, data)
        return None

    def _make_room(self, nbytes: int) -> bool:
        while self.used_bytes + nbytes > self.capacity_bytes and self.files:
            block_hash, size = self.files.popitem(last=False)
            self.used_bytes -= size
            self.evicted.append(block_hash)
            self._writer.submit(self._unlink, block_hash)
        return self.used_bytes + nbytes <= self.capacity_bytes

    def _write(self, block_hash: bytes, data: torch.Tensor) -> None:
        """On the writer thread."""
        data = layouts.block_to_rows(data, self.order)
        payload = data.contiguous().view(torch.uint8).numpy().reshape(-1)
        try:
            write_block(self.folder, self.key, block_hash, memoryview(payload))
        except OSError as exc:
            self._done.append((block_hash, exc))
        else:
            self._done.append((block_hash, None))

    def _unlink(self, block_hash: bytes) -> None:
        (self.folder / file_name(block_hash)).unlink(missing_ok=True)

    def reap(self) -> list[tuple[bytes, str]]:
        """Bring the bookkeeping up to the writes that finished; the blocks that failed, each
        with its reason (not written: a full disk, or another error)."""
        failed: list[tuple[bytes, str]] = []
        while self._done:
            block_hash, exc = self._done.popleft()
            if block_hash not in self.pending:
                continue  # cleared meanwhile: the writer deletes it after
            self.pending.discard(block_hash)
            if exc is None:
                self.files[block_hash] = self.file_bytes
            else:
                self.used_bytes -= self.file_bytes
                failed.append((block_hash, "disk_full" if exc.errno == errno.ENOSPC
                               else "write_error"))
                log.warning("KV disk tier: writing a block failed: %s", exc)
        return failed

    def flush(self) -> None:
        """Wait for the queued writes (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    # ----------------------------------------------------------------- reading

    def read_many(self, hashes: Sequence[bytes]) -> Future[list[torch.Tensor | LoadFailed]]:
        """Read blocks in chain order on the reader thread, stopping after the first that
        fails (what follows it is of no use without it)."""
        return self._reader.submit(self._read_many, list(hashes))

    def _read_many(self, hashes: list[bytes]) -> list[torch.Tensor | LoadFailed]:
        out: list[torch.Tensor | LoadFailed] = []
        for block_hash in hashes:
            try:
                payload = read_block(self.folder / file_name(block_hash), self.key, block_hash,
                                     self.block_bytes)
            except LoadFailed as exc:
                out.append(exc)
                break
            block = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).reshape(
                self.block_shape)
            out.append(layouts.block_from_rows(block, self.order))
        return out

    def discard(self, block_hash: bytes) -> None:
        """Forget a block whose file failed to load, and delete the file."""
        if self.files.pop(block_hash, None) is not None:
            self.used_bytes -= self.file_bytes
            self._writer.submit(self._unlink, block_hash)

    def close(self) -> None:
        """Finish the queued writes and give the folder up (the next worker takes it over)."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def clear(self) -> None:
        """Drop every block (files are deleted behind any queued write of them)."""
        for block_hash in (*self.files, *self.pending):
            self._writer.submit(self._unlink, block_hash)
        self.files.clear()
        self.pending.clear()
        self.used_bytes = 0
