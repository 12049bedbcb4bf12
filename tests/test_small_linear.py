"""The small-row linear kernel against float64 products, which layers take it, and how the row
count is measured."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.models import small_linear
from prefixserve.workers.models.layers import CPULayerOps, LayerOps
from prefixserve.workers.models.quantization import METHODS, QuantizedLinear

KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")
# (out, in): whole vectors, a ragged tail, fewer inputs than one vector, a model's shape
SHAPES = [(40, 64), (33, 72), (7, 10), (960, 576)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return (out if b is None else out + b.double()).to(x.dtype)


def check_small_linear(kernels, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        for m in range(1, kernels.small_linear_max_rows + 1):
            x = torch.randn(m, k, generator=gen).to(dtype)
            for bias in (None, b):
                got = kernels.small_linear(x, w, bias)
                assert got.dtype == dtype and got.shape == (m, n)
                ref = reference(x, w, bias)
                if dtype == torch.float32:  # a float sum in another order
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
                else:  # rounded once from a float sum: at most one bf16 step off
                    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_the_kernel_computes_x_times_w_transposed_plus_bias_at_every_row_count(dtype) -> None:
    check_small_linear(KERNELS, dtype)


@needs_kernels
def test_the_kernel_refuses_what_it_cannot_read() -> None:
    k, w = KERNELS, torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="it takes 1 to 8"):
        k.small_linear(torch.randn(9, 16), w)
    with pytest.raises(RuntimeError, match="it takes 1 to 8"):
        k.small_linear(torch.randn(0, 16), w)
    with pytest.raises(RuntimeError, match="x must be \\[M, K\\] and w \\[N, K\\]"):
        k.small_linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        k.small_linear(torch.randn(16, 2).t(), w)
    with pytest.raises(RuntimeError, match="share a dtype"):
        k.small_linear(torch.randn(2, 16), w.bfloat16())
    with pytest.raises(RuntimeError, match="bias must be \\[N\\]"):
        k.small_linear(torch.randn(2, 16), w, torch.randn(7))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        k.small_linear(torch.randn(2, 16).half(), w.half())


class Spy(SimpleNamespace):
    """The real kernels, counting the rows each `small_linear` call got."""

    def __init__(self, kernels) -> None:
        super().__init__(calls=[])
        self.kernels = kernels

    def small_linear(self, x, w, b=None):
        self.calls.append(x.shape[0])
        return self.kernels.small_linear(x, w, b)


@needs_kernels
def test_plain_linear_layers_at_up_to_small_rows_take_the_kernel_and_the_rest_their_forward():
    spy = Spy(KERNELS)
    ops = CPULayerOps(spy, small_rows=3)
    layer = nn.Linear(72, 40, bias=True)
    x = torch.randn(5, 72)
    with torch.no_grad():
        for m in (1, 3):
            got = ops.linear(layer, x[:m])
            assert torch.equal(got, KERNELS.small_linear(x[:m], layer.weight, layer.bias))
        assert spy.calls == [1, 3]
        assert torch.equal(ops.linear(layer, x[:4]), layer(x[:4]))  # above small_rows
        strided = x.t().contiguous().t()[:2]
        assert torch.equal(ops.linear(layer, strided), layer(strided))
        transposed = nn.Linear(40, 72)  # its weight a strided view: BLAS reads it as it is
        transposed.weight = nn.Parameter(torch.randn(40, 72).t())
        assert torch.equal(ops.linear(transposed, x[:2, :40].contiguous()),
                           transposed(x[:2, :40].contiguous()))
        packed = QuantizedLinear(nn.Linear(64, 32, bias=False), METHODS["int8"])
        y = torch.randn(2, 64)
        assert torch.equal(ops.linear(packed, y), packed(y))
        assert torch.equal(LayerOps().linear(layer, x[:1]), layer(x[:1]))
        assert torch.equal(CPULayerOps(spy).linear(layer, x[:1]), layer(x[:1]))  # small_rows 0
    assert spy.calls == [1, 3]  # none of the others went through the kernel


def test_the_row_count_is_the_last_before_the_kernel_stops_winning() -> None:
    """Timed with stand-in products whose speeds are known: the kernel's slows past 2 rows."""
    def kernel(x, w):
        time.sleep(0.002 if x.shape[0] > 2 else 0)

    def blas(x, w):
        time.sleep(0.001)

    assert small_linear.measure_rows(kernel, blas, 8, torch.float32, probe_bytes=1) == 2
    assert small_linear.measure_rows(blas, kernel, 8, torch.float32, probe_bytes=1) == 0
    assert small_linear.measure_rows(lambda x, w: None, blas, 5, torch.float32,
                                     probe_bytes=1) == 5


@needs_kernels
def test_the_row_count_can_be_pinned_and_is_measured_once(monkeypatch) -> None:
    monkeypatch.setenv(small_linear.ENV, "3")
    assert small_linear.small_linear_rows(KERNELS, torch.float32) == 3
    monkeypatch.setenv(small_linear.ENV, "99")
    assert small_linear.small_linear_rows(KERNELS, torch.float32) == KERNELS.small_linear_max_rows
    monkeypatch.setenv(small_linear.ENV, "0")
    assert small_linear.small_linear_rows(KERNELS, torch.float32) == 0
    monkeypatch.setenv(small_linear.ENV, "few")
    with pytest.raises(ValueError, match="whole number of rows, not 'few'"):
        small_linear.small_linear_rows(KERNELS, torch.float32)
    first = measured_once(monkeypatch, small_linear,
                          lambda: small_linear.small_linear_rows(KERNELS, torch.float32))
    assert 0 <= first <= KERNELS.small_linear_max_rows


def measured_once(monkeypatch, module, choose):
    """`choose()` with `module`'s pins (`ENV`, or each of `ENVS`) unset and its probe
    (`PROBE_BYTES`) cut to the least: the first call measures, the second takes the cached
    choice. Returns the first."""
    for env in getattr(module, "ENVS", None) or (module.ENV,):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(module, "PROBE_BYTES", 1)
    module._measured.cache_clear()
    try:
        first = choose()
        assert module._measured.cache_info().misses == 1
        assert choose() == first
        assert module._measured.cache_info().hits == 1
    finally:
        module._measured.cache_clear()
    return first
