"""Weight-only quantization of a model's linear layers (CPU): int4 or int8 weights that torch's
packed kernels stream for decode.

A single stream's decode step reads every weight once for one row of activations, so its time
is the weights' bytes. torch's packed CPU kernels read int4 (an eighth of fp32's bytes) or int8
with bf16 activations; at one row the int4 one ran SmolLM2-135M's layers 6x faster than dense
fp32. At many rows (prefill, big decode batches) the dense matmul is faster, so each layer also
keeps its dequantized weights as a dense copy: both paths compute the same quantized model, and
a batch's row count picks one. Where the paths cross is measured when the model is quantized,
on its own layers, not guessed.

- int4: groups of 32 inputs, each with a scale and an offset, w = (q - 8)·s + z for q in 0..15
  (GGUF's Q4_1 has the same shape); s and z in bf16, as the kernel takes them.
- int8: one bf16 scale per output row, symmetric, q in -127..127.

A layer whose widths the kernel does not take (int4: inputs a multiple of 32, outputs of 16; int8:
inputs a multiple of 16) stays dense.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.router.registry import Registry
from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.models.crossover import REPS, Pass, best_ms, last_faster

log = logging.getLogger(__name__)

INT4_GROUP = 32
INT4_KERNEL_ENV = "PREFIXSERVE_INT4_KERNEL"
INT4_PROBE_BYTES = 64 << 20  # packed weights read per timed pass: past a server CPU's caches
INT4_PROBE_SHAPE = (3072, 576)  # a small model's gate/up projection
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes the crossover is measured at
Dense = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (a layer, x) -> x times its weight

Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # packed, scales, dequantized (fp32)


@dataclass(frozen=True)
class Method:
    """One quantization: how a weight [out, in] packs, and the kernel that multiplies by it."""

    name: str
    # the kernel's shapes (it crashes the process on others): `in` and `out` multiples of these
    in_multiple: int
    out_multiple: int
    pack: Callable[[torch.Tensor], Packed]
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # y in x's dtype
    kernel: str = "torch"  # whose packed kernel: torch's, or prefixserve's own

    def packs(self, layer: nn.Linear) -> bool:
        return not (layer.in_features % self.in_multiple or layer.out_features % self.out_multiple)


def _int4_levels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `INT4_GROUP`: each group's min and max span q = 0..15.
    Returns q [out, in / G, G] (floats 0..15), and each group's scale and the value q = 8
    decodes to [out, in / G], both bf16-exact."""
    w = weight.detach().float()
    groups = w.unflatten(1, (-1, INT4_GROUP))  # [out, in / G, G]
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).bfloat16().float()
    zero = (lo + 8 * scale).bfloat16().float()
    q = ((groups - zero[..., None]) / scale[..., None] + 8).round_().clamp_(0, 15)
    return q, scale, zero


def _dense(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return ((q - 8) * scale[..., None] + zero[..., None]).flatten(1)


def pack_int4(weight: torch.Tensor) -> Packed:
    """torch's int4 layout: its packed tensor, and (scale, zero) per group in bf16."""
    q, scale, zero = _int4_levels(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.flatten(1).int(), 1)
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return packed, scales, _dense(q, scale, zero)


def _int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, INT4_GROUP,
                                                   scales)
    return y.to(x.dtype)


def pack_int4_rows(weight: torch.Tensor) -> Packed:
    """prefixserve's int4 layout (`csrc/int4_linear.cpp`), the same levels as `pack_int4`'s:
    each output's groups in order, 16 bytes each (byte i: q[i] low, q[16 + i] high), and
    float32 (scale, offset) per group, w = q * scale + offset."""
    q, scale, zero = _int4_levels(weight)
    nibbles = q.to(torch.uint8)
    packed = (nibbles[..., : INT4_GROUP // 2] | (nibbles[..., INT4_GROUP // 2 :] << 4))
    scales = torch.stack([scale, zero - 8 * scale], dim=-1).contiguous()
    return packed.flatten(1).contiguous(), scales, _dense(q, scale, zero)


def pack_int8(weight: torch.Tensor) -> Packed:
    """Symmetric int8 with one scale per output row."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-8).bfloat16().float()
    q = (w / scale[:, None]).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale.bfloat16(), q * scale[:, None]


def _int8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), packed, scales).to(x.dtype)


METHODS: Registry[Method] = Registry("quantization", {
    "int4": Method("int4", INT4_GROUP, 16, pack_int4, _int4_matmul),
    "int8": Method("int8", 16, 1, pack_int8, _int8_matmul),
})


class QuantizedLinear(nn.Module):
    """A linear layer held packed for the kernel and dense (dequantized, in the model's dtype)
    for batches of more than `packed_rows` rows."""

    def __init__(self, linear: nn.Linear, method: Method) -> None:
        super().__init__()
        packed, scales, dense = method.pack(linear.weight)
        self.method = method
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("weight", dense.to(linear.weight.dtype))
        self.bias = linear.bias
        self.packed_rows = CROSSOVER_ROWS[-1]  # until measured

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.packed_rows:
            return F.linear(x, self.weight, self.bias)
        return self.forward_packed(x)

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.matmul(x, self.packed, self.scales)
        return y if self.bias is None else y.add_(self.bias)

    def packed_bytes(self) -> int:
        """What one packed pass reads."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def quantize_model(model: nn.Module, name: str, packed_rows: int | None = None,
                   dense: Dense | None = None) -> str:
    """Replace each linear layer of `model` that the method can pack by a QuantizedLinear (the
    LM head too: a tied one gets its own packed copy, the embedding stays as it was). The
    packed kernels take batches of up to `packed_rows` rows; None measures where they stop
    being faster than `dense` (the model's layer ops' dense product). Returns a line for the
    start-up log."""
    method = METHODS.lookup(name)
    weight = next(model.parameters())
    if weight.device.type != "cpu":
        raise UnsupportedModelError(f"quantization {name!r} runs on CPU only, not "
                                    f"{weight.device}")
    if name == "int4":
        method = int4_method(weight.dtype)
    layers: list[QuantizedLinear] = []
    unpacked: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if not method.packs(child):
                unpacked.append(f"{parent_name}.{child_name}".lstrip("."))
                continue
            layer = QuantizedLinear(child, method)
            setattr(parent, child_name, layer)
            layers.append(layer)
    if not layers:
        raise UnsupportedModelError(f"quantization {name!r}: no linear layer of this model has "
                                    f"widths it packs ({_widths(method)})")
    timings = ""
    if packed_rows is None:
        packed_rows, times = measure_crossover(layers, dense=dense)
        timings = " (measured, packed/dense ms a pass: " + ", ".join(
            f"{m} rows {p:.3g}/{d:.3g}" for m, (p, d) in times.items()) + ")"
    for layer in layers:
        layer.packed_rows = packed_rows
    kept = f"; {len(unpacked)} kept dense (it packs {_widths(method)})" if unpacked else ""
    return (f"quantization {name}: {len(layers)} linear layers packed, {method.kernel}'s "
            f"kernel taking batches of up to {packed_rows} rows{timings}{kept}")


def _widths(method: Method) -> str:
    outs = f", outputs a multiple of {method.out_multiple}" if method.out_multiple > 1 else ""
    return f"inputs a multiple of {method.in_multiple}{outs}"


def measure_crossover(layers: list[QuantizedLinear], reps: int = REPS, dense: Dense | None = None,
                      ) -> tuple[int, dict[int, tuple[float, float]]]:
    """The most rows at which a pass over every layer is faster packed than dense (by `dense`,
    the way the model's layer ops multiply by a dense weight; torch's linear by default),
    trying `CROSSOVER_ROWS` in order until dense wins (0: dense wins at one row); and each tried
    row count's best (packed, dense) ms."""
    dtype = layers[0].weight.dtype
    dense = dense or (lambda q, x: F.linear(x, q.weight, q.bias))

    def passes(rows: int) -> tuple[Pass, Pass]:
        inputs = {n: torch.randn(rows, n, dtype=dtype)
                  for n in {layer.in_features for layer in layers}}
        return (lambda: [q.forward_packed(inputs[q.in_features]) for q in layers],
                lambda: [dense(q, inputs[q.in_features]) for q in layers])

    with torch.inference_mode():
        return last_faster(passes, CROSSOVER_ROWS, reps)


def int4_rows_method(kernels: ModuleType) -> Method:
    """int4 through prefixserve's kernel: float activations, weights widened in registers."""
    def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return kernels.int4_linear(x.contiguous(), packed, scales)

    return Method("int4", INT4_GROUP, 16, pack_int4_rows, matmul, "prefixserve")


def int4_method(dtype: torch.dtype = torch.float32) -> Method:
    """The int4 kernel this process runs for a model in `dtype`: `PREFIXSERVE_INT4_KERNEL`
    (`torch` or `prefixserve`) pins it; else prefixserve's where it is faster at one row,
    measured once (torch's takes bf16 activations, which CPUs without AVX512-BF16 or AMX
    emulate)."""
    kernels = cpu_kernels()
    pinned = os.environ.get(INT4_KERNEL_ENV, "").strip()
    if pinned not in ("", "torch", "prefixserve"):
        raise ValueError(f"{INT4_KERNEL_ENV} must be torch or prefixserve, not {pinned!r}")
    if pinned == "torch":
        return METHODS["int4"]
    if kernels is None:
        if pinned:
            raise RuntimeError(f"{INT4_KERNEL_ENV}=prefixserve, but the CPU kernels could not "
                               "be built here")
        return METHODS["int4"]
    if pinned or _own_int4_faster(kernels, dtype, torch.get_num_threads()):
        return int4_rows_method(kernels)
    return METHODS["int4"]


@functools.cache
def _own_int4_faster(kernels: ModuleType, dtype: torch.dtype, threads: int) -> bool:
    """Both int4 kernels at one row of `dtype` over `INT4_PROBE_BYTES` of packed weights
    (random levels: the time does not depend on them)."""
    n, k = INT4_PROBE_SHAPE
    count = max(1, INT4_PROBE_BYTES // (n * k // 2))
    scales = torch.full((n, k // INT4_GROUP, 2), 0.01)
    ours = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) for _ in range(count)]
    theirs = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 1) for _ in range(count)]
    their_scales = scales.transpose(0, 1).contiguous().bfloat16()
    x = torch.full((1, k), 0.5, dtype=dtype)
    started = time.perf_counter()
    own_ms = best_ms(lambda: [kernels.int4_linear(x, w, scales) for w in ours], REPS)
    torch_ms = best_ms(lambda: [_int4_matmul(x, w, their_scales) for w in theirs], REPS)
    log.info("int4 at one %s row: prefixserve's kernel %.3g ms, torch's %.3g ms over %d MiB "
             "(%d threads, measured in %.1f s)", str(dtype).removeprefix("torch."), own_ms,
             torch_ms, count * n * k // 2 >> 20, threads, time.perf_counter() - started)
    return own_ms < torch_ms
