"""Decode steps replayed from CUDA graphs: one captured forward per batch and context size.

A decode step's work is fixed by two numbers, its sequences and their longest block table, but
launching it op by op costs the GPU more than running it at small batches: hundreds of kernel
launches a step for a model this size. As vLLM, SGLang and nano-vllm do, a decode step whose
shape fits is padded up to a captured (batch, width) bucket and replayed as one graph.

What a captured step may not do is read anything on the host or change shape, so it runs on
static buffers that each step copies its inputs into, and its attention is the torch backend's
plan built from device tensors only (`SDPAPlan.static_decode`). Rows past the real batch are
padding, whose K/V goes to a scratch block the block pool never hands out, so a padded row
cannot overwrite a sequence's KV.

Capture is lazy: a bucket's graph is captured the first time a step needs it (a few tens of
milliseconds), and every graph allocates from one shared memory pool. Where there is no CUDA
the same buckets, buffers and padding run eagerly, which is how the tests check all of this but
the capture call itself against the engine's ordinary step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.attention.torch_sdpa import SDPAPlan, TorchSDPABackend
from prefixserve.workers.kv_cache import cdiv
from prefixserve.workers.models.base import CausalLM

log = logging.getLogger(__name__)

# Contexts past this many tokens decode eagerly (vLLM's default max_seq_len_to_capture): the
# captured attention reads its whole bucket's width, and one graph per width doubling past it
# would hold memory for rare steps.
MAX_CAPTURED_CONTEXT = 8192


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8, as vLLM's defaults."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return [*sizes, max_num_seqs]


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths captured: powers of two, then the widest a captured step may have."""
    widths, w = [], 1
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return [*widths, max_blocks]


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest size that holds n; None past the largest."""
    return next((s for s in sizes if s >= n), None)


def graphs_by_default(model: CausalLM, device: torch.device, enforce_eager: bool) -> bool:
    """On a GPU unless told to run eagerly, where the model attends through the torch backend
    (a paged GPU kernel would bring its own capture rules)."""
    return (device.type == "cuda" and not enforce_eager
            and isinstance(model.attention, TorchSDPABackend))


class StaticDecodeMetadata(AttentionMetadata):
    """A captured step's metadata: its lengths exist only on the device."""

    def host_lens(self) -> tuple[list[int], list[int]]:
        raise RuntimeError("a captured decode step cannot read its lengths on the host")


# One bucket's step: returns its logits [batch, vocab] (on CUDA a replay, which writes the same
# output tensor each time).
Graph = Callable[[], torch.Tensor]


class DecodeGraphs:
    """Pads fitting decode steps to a bucket and runs the bucket's graph.

    `scratch_block` is a block of the KV tensor outside the block pool: the padding's.
    """

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int,
                 max_num_seqs: int, max_model_len: int, scratch_block: int) -> None:
        if not isinstance(model.attention, TorchSDPABackend):
            raise ValueError(f"decode graphs need the torch_sdpa attention backend, not "
                             f"{model.attention.name}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.batches = batch_buckets(max_num_seqs)
        self.widths = width_buckets(cdiv(min(max_model_len, MAX_CAPTURED_CONTEXT), block_size))
        self.scratch_slot = scratch_block * block_size
        b, w = self.batches[-1], self.widths[-1]

        def buffer(*shape: int, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.long, device=self.device)

        self.input_ids = buffer(b, fill=0)
        self.positions = buffer(b, fill=0)
        self.slot_mapping = buffer(b, fill=self.scratch_slot)
        self.context_lens = buffer(b, fill=1)
        self.block_tables = buffer(b, w, fill=scratch_block)
        self.rows = torch.arange(b + 1, device=self.device)
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.capturing = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capturing else None

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether the step is all decode rows, each sampled, within the largest bucket."""
        n, width = meta.block_tables.shape
        query_lens, _ = meta.host_lens()
        return (all(q == 1 for q in query_lens) and meta.logits_indices.numel() == n
                and n <= self.batches[-1] and width <= self.widths[-1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The step's logits [n, vocab] float32, from its bucket's graph (captured if new)."""
        n, width = meta.block_tables.shape
        b, w = bucket(self.batches, n), bucket(self.widths, width)
        assert b is not None and w is not None, "run only steps that fit"
        self._load(input_ids, positions, meta, b)
        graph = self.graphs.get((b, w))
        if graph is None:
            graph = self.graphs[(b, w)] = self._capture(b, w)
        return graph()[:n].clone()

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              b: int) -> None:
        """Copy the step into the static buffers. A padded row keeps what an earlier, larger
        step left in them: it reads blocks under a mask that allows at least one key, and its
        logits are dropped; only its write must go to the scratch slot."""
        n, width = meta.block_tables.shape
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(self.scratch_slot)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)  # past width: masked

    def _step(self, b: int, w: int) -> Graph:
        """The bucket's forward over the static buffers: no host reads, fixed shapes."""

        def step() -> torch.Tensor:
            meta = StaticDecodeMetadata(
                slot_mapping=self.slot_mapping[:b],
                query_start_loc=self.rows[: b + 1],
                context_lens=self.context_lens[:b],
                block_tables=self.block_tables[:b, :w],
                logits_indices=self.rows[:b],
            )
            meta.backend_state = SDPAPlan.static_decode(meta, self.block_size,
                                                        self.model.dtype)
            return self.model(self.input_ids[:b], self.positions[:b], meta, self.kv_cache)

        return step

    def _capture(self, b: int, w: int) -> Graph:
        """The bucket's graph; off a GPU, or once a capture has failed, its step run eagerly
        (the same buffers and padding)."""
        step = self._step(b, w)
        if not self.capturing:
            return step
        try:
            graph, out = self._record(step)
        except RuntimeError as exc:  # an op that cannot be captured: serve on, uncaptured
            log.warning("capturing a decode graph failed (%s); decode steps run eagerly", exc)
            self.capturing = False
            return step
        log.info("captured decode graph: %d sequences, %d blocks each (%d graphs)", b, w,
                 len(self.graphs) + 1)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def _record(self, step: Graph) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture `step` into one graph of the shared pool, after a warm-up on a side stream
        (cuBLAS workspaces and lazy inits must not be captured). The buffers hold the current
        step's inputs, so the warm-up writes only what the replay writes again."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        return graph, out
