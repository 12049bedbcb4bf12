"""The fused CPU layer ops against torch's: the same model, op by op.

bf16 must round where the torch sequence rounds (the normalised row before the weight, the
residual sum, silu before the multiply), so almost every element is bit-equal and none is more
than one bf16 step away; fp32 differs only in the order of a sum."""

from __future__ import annotations

import pytest
import torch

from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.models import layers
from prefixserve.workers.models.layers import CPULayerOps, LayerOps, layer_ops_for

KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")
DTYPES = (torch.float32, torch.bfloat16)
SHAPES = [(1, 64), (5, 72), (40, 576)]  # rows; widths of whole vectors, a ragged tail, the model's


def assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: equal to 1e-6 relative. bf16: ≥ 99% of elements bit-equal, the rest one step away
    (a float sum taken in another order can land a value on the other side of a rounding)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        return
    assert (got == ref).float().mean() >= 0.99
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-6)


def rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (3 * torch.randn(n, width, generator=torch.Generator().manual_seed(seed))).to(dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,width", SHAPES)
def test_norms_match_torch_and_the_residual_stream_is_updated_in_place(dtype, n, width) -> None:
    check_norms(KERNELS, dtype, n, width)


def check_norms(kernels, dtype: torch.dtype, n: int, width: int) -> None:
    fused, torch_ops = CPULayerOps(kernels), LayerOps()
    x, residual, w = rows(n, width, dtype, 0), rows(n, width, dtype, 1), rows(1, width, dtype, 2)[0]
    assert_same(fused.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5))

    ref_residual = residual.clone()
    ref = torch_ops.add_rms_norm_(x.clone(), ref_residual, w, 1e-5)
    got_x, got_residual = x.clone(), residual.clone()
    got = fused.add_rms_norm_(got_x, got_residual, w, 1e-5)
    assert torch.equal(got_residual, ref_residual)  # one add, rounded once: exact
    assert torch.equal(ref_residual, (residual.float() + x.float()).to(dtype))
    assert got.data_ptr() == got_x.data_ptr()  # the normalised rows overwrite x
    assert_same(got, ref)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_in_place_and_leaves_v(dtype) -> None:
    check_rope(KERNELS, dtype)


def check_rope(kernels, dtype: torch.dtype) -> None:
    fused, torch_ops = CPULayerOps(kernels), LayerOps()
    n, heads, rotated, dim = 33, 15, 12, 64
    qkv = rows(n, heads * dim, dtype, 3).view(n, heads, dim)
    positions = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(4))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    ref, got = qkv.clone(), qkv.clone()
    torch_ops.rope_(ref, torch_ops.rope_angles(positions, inv_freq), rotated)
    fused.rope_(got, fused.rope_angles(positions, inv_freq), rotated)
    assert torch.equal(got[:, rotated:], qkv[:, rotated:])
    assert not torch.equal(got[:, :rotated], qkv[:, :rotated])
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5)  # sin/cos of angles ~4096
    else:
        assert_same(got, ref)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,width", SHAPES)
def test_silu_mul_matches_torch(dtype, n, width) -> None:
    check_silu_mul(KERNELS, dtype, n, width)


def check_silu_mul(kernels, dtype: torch.dtype, n: int, width: int) -> None:
    gate_up = rows(n, 2 * width, dtype, 5)
    assert_same(CPULayerOps(kernels).silu_mul(gate_up), LayerOps().silu_mul(gate_up))


def check_every_op(kernels) -> None:
    """Every check above on another build of the kernels (tests/test_attention_kernel.py builds
    them for narrower vectors)."""
    for dtype in DTYPES:
        check_rope(kernels, dtype)
        for n, width in SHAPES:
            check_norms(kernels, dtype, n, width)
            check_silu_mul(kernels, dtype, n, width)


@needs_kernels
def test_the_kernels_refuse_what_they_cannot_read() -> None:
    k, x, w = KERNELS, torch.randn(4, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="contiguous"):
        k.rms_norm(x.t().contiguous().t(), w, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be contiguous, of x's dtype"):
        k.rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be contiguous, of x's dtype and row"):
        k.rms_norm(x, torch.randn(32), 1e-5)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        k.silu_mul(x.half())
    with pytest.raises(RuntimeError, match="residual must be contiguous, of x's shape"):
        k.add_rms_norm_(x, torch.randn(3, 64), w, 1e-5)
    qkv = torch.randn(4, 3, 64)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        k.rope_(qkv, torch.randn(4, 16), torch.randn(4, 16), 2)
    with pytest.raises(RuntimeError, match="`heads` of them rotated"):
        k.rope_(qkv, torch.randn(4, 32), torch.randn(4, 32), 4)


def test_the_device_and_dtype_choose_the_ops(monkeypatch) -> None:
    expected = CPULayerOps if KERNELS is not None else LayerOps
    assert type(layer_ops_for("cpu", torch.float32)) is expected
    assert type(layer_ops_for("cpu", torch.bfloat16)) is expected
    assert type(layer_ops_for("cpu", torch.float16)) is LayerOps  # the kernels take fp32, bf16
    assert type(layer_ops_for("meta", torch.float32)) is LayerOps
    monkeypatch.setattr(layers, "cpu_kernels", lambda: None)
    assert type(layer_ops_for("cpu", torch.float32)) is LayerOps
