"""Turn a scheduled batch into one forward pass: flat token rows, paged-attention metadata, logits.

All per-step host work is O(scheduled sequences + their blocks); token ids and positions of a
prefill chunk are copied by slicing, and the slot mapping for every row is one vectorised numpy
expression over the block tables. `keep_cpu_heap` keeps those passes off the page-fault path on
CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence as Seq

import numpy as np
import torch

from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.decode_graphs import DecodeGraphs
from prefixserve.workers.lora import LoRAAdapter, LoRABatch
from prefixserve.workers.models.base import CausalLM
from prefixserve.workers.scheduler import SchedulerOutput, Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.graphs = graphs  # decode steps that fit replay from here; None: every step eager

    def prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[Sequence]]:
        """Inputs of the step and the sequences whose last row yields logits (in row order)."""
        bs = self.block_size
        seqs, counts = sched.seqs, sched.num_new_tokens
        tables = sched.tables
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(seqs), width), dtype=np.int64)
        input_ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        row = 0
        for i, (seq, n, table) in enumerate(zip(seqs, counts, tables, strict=True)):
            block_tables[i, : len(table)] = [b.block_id for b in table]
            start = seq.num_computed_tokens
            end = start + n
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
            context_lens.append(end)
            row += n
            if end == seq.num_tokens:
                logits_rows.append(row - 1)
                sampled.append(seq)
        pos = np.asarray(positions, dtype=np.int64)
        seq_of_row = np.repeat(np.arange(len(seqs)), counts)
        slots = block_tables[seq_of_row, pos // bs] * bs + pos % bs
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            query_lens_cpu=list(counts),
            context_lens_cpu=context_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        return ids, torch.from_numpy(pos).to(dev), meta, sampled

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, adapters: Seq[LoRAAdapter | None] | None = None,
                ) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run the batch, each sequence under its LoRA adapter (`adapters`, one per scheduled
        sequence; None: the base model); logits [len(sampled), vocab] float32 (None when
        nothing samples)."""
        ids, positions, meta, sampled = self.prepare(sched)
        if adapters is None and self.graphs is not None and self.graphs.fits(meta):
            return self.graphs.run(ids, positions, meta), sampled
        lora = None if adapters is None else LoRABatch.of(adapters, sched.num_new_tokens,
                                                          self.device)
        logits = self.model(ids, positions, meta, self.kv_cache, lora)
        return (logits if sampled else None), sampled


def keep_cpu_heap() -> None:
    """Stop glibc from handing freed activations back to the OS after every op (CPU only).

    By default each tensor over 128 KiB is a fresh mmap, so every layer of every step page-faults
    its outputs in again; on this kind of VM that made prefill 4-5x slower than the matmuls
    allow. Raising the mmap and trim thresholds keeps freed blocks in the heap for reuse (what
    vLLM's CPU backend gets by preloading tcmalloc). Process-wide, harmless elsewhere.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD (capped by glibc at 32 MiB)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        return
