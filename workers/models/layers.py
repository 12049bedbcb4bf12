"""Building blocks shared by Llama-family models: RMSNorm, RoPE (with its scalings), the ops
between a layer's matmuls and the matmuls' entry point, behind one seam (`LayerOps`) so a device
can fuse them.

At a decode step's few rows, torch's norm, RoPE and activation are a dozen small kernels a layer,
each costing more to dispatch than to compute: a tenth to a sixth of a CPU decode step.
`CPULayerOps` runs each as one pass of prefixserve's CPU kernels (`workers.kernels`), a plain
linear layer at a few rows through the small-row kernel where it measured faster than BLAS
(`workers.models.small_linear`), and at more rows over oneDNN's packed copy of its weight where
that measured faster than torch's linear (`workers.models.packed_linear`), or in bf16 over
tile weights (AMX, or AVX512-BF16's pairs) where those measured faster still
(`workers.models.tile_linear`); `LayerOps` is the torch version, for every other device and
dtype and where the kernels cannot be built. Both round where HF's Llama rounds, so they compute
the same model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.router.registry import Registry
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.models.packed_linear import PackedWeights, packed_counts
from prefixserve.workers.models.packed_linear import linear as packed_linear
from prefixserve.workers.models.quantization import QuantizedLinear
from prefixserve.workers.models.small_linear import small_linear_rows
from prefixserve.workers.models.tile_linear import tile_counts

if TYPE_CHECKING:
    from prefixserve.workers.models.config import ModelConfig


class LayerOps:
    """The norms, RoPE and activation as torch ops: any device, any dtype."""

    name = "torch"

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A projection or the LM head applied to x's rows (the module's own forward)."""
        return layer(x)

    def dense(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x's rows times a layer's dense `weight` (plus its `bias`): a plain linear layer's, or
        a quantized one's dequantized copy."""
        return F.linear(x, layer.weight, layer.bias)

    def rope_angles(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> Any:
        """What `rope_` takes for a step's rows at `positions` (computed once per step)."""
        freqs = positions[:, None].float() * inv_freq[None, :]
        return torch.polar(torch.ones_like(freqs), freqs)[:, None, :]

    def rope_(self, qkv: torch.Tensor, angles: Any, heads: int) -> None:
        """RoPE in place on the first `heads` heads of qkv [T, heads + ..., D] (q's and k's)."""
        qkv[:, :heads] = apply_rope(qkv[:, :heads], angles)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        # Normalise in float32 like the reference, then scale in the model dtype.
        return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """`residual += x` in place, then its rows normalised (x may be overwritten with them):
        a sublayer's output joins the residual stream and the next sublayer's input is its
        norm."""
        return self.rms_norm(residual.add_(x), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation: silu(gate) * up, gate and up the two halves of each row."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one less big allocation


class CPULayerOps(LayerOps):
    """The same ops, each one call of the CPU kernels (float32 and bfloat16)."""

    name = "cpu_fused"

    def __init__(self, kernels: ModuleType, small_rows: int = 0,
                 packed: PackedWeights | None = None, tiles: PackedWeights | None = None) -> None:
        self.kernels = kernels
        self.small_rows = small_rows  # linear layers at 1 to this many rows: the kernel's
        self.packed = packed  # more rows over packed weights, at the counts it covers
        self.tiles = tiles  # bf16 over tile weights, at the counts it covers, before either

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A plain linear layer, and a quantized one at more rows than its packed kernel takes,
        multiply by their dense weight as `dense` does; anything else through its forward."""
        if type(layer) is nn.Linear or (type(layer) is QuantizedLinear
                                        and x.shape[0] > layer.packed_rows):
            return self.dense(layer, x)
        return layer(x)

    def dense(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Rows of the weight's dtype go over tile weights at the row counts where they measured
        faster, else through the small-row kernel at a few contiguous ones, over the packed
        weight at the row counts where packing measured faster; anything else through torch's
        linear."""
        if x.dim() != 2 or x.shape[0] == 0 or x.dtype != layer.weight.dtype:
            return F.linear(x, layer.weight, layer.bias)
        if self.tiles is not None and self.tiles.covers(x.shape[0]) and x.stride(1) == 1:
            return self.kernels.tile_linear(x, self.tiles.of(layer), layer.out_features,
                                            layer.bias)
        if (x.shape[0] <= self.small_rows and x.is_contiguous()
                and layer.weight.is_contiguous()):
            return self.kernels.small_linear(x, layer.weight, layer.bias)
        if self.packed is not None and self.packed.covers(x.shape[0]):
            return packed_linear(x, self.packed.of(layer), layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def rope_angles(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> Any:
        freqs = positions[:, None].float() * inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def rope_(self, qkv: torch.Tensor, angles: Any, heads: int) -> None:
        self.kernels.rope_(qkv, *angles, heads)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        return self.kernels.add_rms_norm_(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)


def _torch(dtype: torch.dtype) -> LayerOps:
    return LayerOps()


def _cpu(dtype: torch.dtype) -> LayerOps:
    kernels = cpu_kernels() if dtype in (torch.float32, torch.bfloat16) else None
    if kernels is None:
        return LayerOps()
    packed = packed_counts(dtype)
    small = small_linear_rows(kernels, dtype, packed)
    tiles = tile_counts(kernels, dtype, small, packed)
    return CPULayerOps(kernels, small, PackedWeights(packed) if packed else None,
                       PackedWeights(tiles, kernels.tile_pack) if tiles else None)


# Device type -> the layer ops for a model dtype there; elsewhere torch's.
OPS: Registry[Callable[[torch.dtype], LayerOps]] = Registry("layer ops", {"cpu": _cpu},
                                                            default=_torch)


def layer_ops_for(device: torch.device | str, dtype: torch.dtype) -> LayerOps:
    return OPS.lookup(torch.device(device).type)(dtype)


class RMSNorm(nn.Module):
    """RMSNorm's weight and eps; the model's `LayerOps` applies it."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ops: LayerOps) -> torch.Tensor:
        """x's rows normalised; with a residual, `residual += x` first and its rows instead."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm_(x, residual, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, heads, D] as one complex multiply by cis [T, 1, D/2] (complex64).

    HF checkpoints rotate dim j with dim j + D/2 ("rotate half"); the loader reorders the q/k
    projection rows of every head to (0, D/2, 1, D/2 + 1, ...), so the pairs sit side by side.
    q.k is unchanged by a permutation applied to both, and the reordered K is what the cache holds.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * cis).flatten(-2).to(x.dtype)


def interleave_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder the output rows (dim 0) of a q/k projection weight or bias for `apply_rope`."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half, head_dim)], dim=1).flatten()
    return w.unflatten(0, (-1, head_dim))[:, perm].flatten(0, 1)


def rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in float32, with the configured scaling."""
    dim = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = c.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    if s["rope_type"] == "freq_factors":  # GGUF's precomputed llama3 divisors
        return inv / torch.tensor(s["factors"], dtype=torch.float32)
    # llama3: long wavelengths slowed by `factor`, short kept, a smooth blend in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
