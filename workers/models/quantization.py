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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.router.registry import Registry
from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.models.crossover import Pass, last_faster

INT4_GROUP = 32
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes the crossover is measured at

Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # packed, scales, dequantized (fp32)


@dataclass(frozen=True)
class Method:
    """One quantization: how a weight [out, in] packs, and the kernel that multiplies by it."""

    name: str
    # the kernel's shapes (it crashes the process on others): `in` and `out` multiples of these
    in_multiple: int
    out_multiple: int
    pack: Callable[[torch.Tensor], Packed]
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # bf16 x

    def packs(self, layer: nn.Linear) -> bool:
        return not (layer.in_features % self.in_multiple or layer.out_features % self.out_multiple)


def pack_int4(weight: torch.Tensor) -> Packed:
    """Asymmetric int4 in groups of `INT4_GROUP`: each group's min and max span q = 0..15."""
    w = weight.detach().float()
    groups = w.unflatten(1, (-1, INT4_GROUP))  # [out, in / G, G]
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).bfloat16().float()
    zero = (lo + 8 * scale).bfloat16().float()  # the value q = 8 decodes to
    q = ((groups - zero[..., None]) / scale[..., None] + 8).round_().clamp_(0, 15)
    dense = ((q - 8) * scale[..., None] + zero[..., None]).flatten(1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.flatten(1).int(), 1)
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return packed, scales, dense


def _int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales)


def pack_int8(weight: torch.Tensor) -> Packed:
    """Symmetric int8 with one scale per output row."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-8).bfloat16().float()
    q = (w / scale[:, None]).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale.bfloat16(), q * scale[:, None]


def _int8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, packed, scales)


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
        y = self.method.matmul(x.to(torch.bfloat16), self.packed, self.scales).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def packed_bytes(self) -> int:
        """What one packed pass reads."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def quantize_model(model: nn.Module, name: str, packed_rows: int | None = None) -> str:
    """Replace each linear layer of `model` that the method can pack by a QuantizedLinear (the
    LM head too: a tied one gets its own packed copy, the embedding stays as it was). The
    packed kernels take batches of up to `packed_rows` rows; None measures where they stop
    being faster. Returns a line for the start-up log."""
    method = METHODS.lookup(name)
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise UnsupportedModelError(f"quantization {name!r} runs on CPU only, not {device}")
    layers: list[QuantizedLinear] = []
    dense: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if not method.packs(child):
                dense.append(f"{parent_name}.{child_name}".lstrip("."))
                continue
            layer = QuantizedLinear(child, method)
            setattr(parent, child_name, layer)
            layers.append(layer)
    if not layers:
        raise UnsupportedModelError(f"quantization {name!r}: no linear layer of this model has "
                                    f"widths it packs ({_widths(method)})")
    timings = ""
    if packed_rows is None:
        packed_rows, times = measure_crossover(layers)
        timings = " (measured, packed/dense ms a pass: " + ", ".join(
            f"{m} rows {p:.3g}/{d:.3g}" for m, (p, d) in times.items()) + ")"
    for layer in layers:
        layer.packed_rows = packed_rows
    kept = f"; {len(dense)} kept dense (it packs {_widths(method)})" if dense else ""
    return (f"quantization {name}: {len(layers)} linear layers packed, the kernel taking "
            f"batches of up to {packed_rows} rows{timings}{kept}")


def _widths(method: Method) -> str:
    outs = f", outputs a multiple of {method.out_multiple}" if method.out_multiple > 1 else ""
    return f"inputs a multiple of {method.in_multiple}{outs}"


def measure_crossover(layers: list[QuantizedLinear], reps: int = 3,
                      ) -> tuple[int, dict[int, tuple[float, float]]]:
    """The most rows at which a pass over every layer is faster packed than dense, trying
    `CROSSOVER_ROWS` in order until dense wins (0: dense wins at one row); and each tried row
    count's best (packed, dense) ms."""
    dtype = layers[0].weight.dtype

    def passes(rows: int) -> tuple[Pass, Pass]:
        inputs = {n: torch.randn(rows, n, dtype=dtype)
                  for n in {layer.in_features for layer in layers}}
        return (lambda: [q.forward_packed(inputs[q.in_features]) for q in layers],
                lambda: [F.linear(inputs[q.in_features], q.weight) for q in layers])

    with torch.inference_mode():
        return last_faster(passes, CROSSOVER_ROWS, reps)
