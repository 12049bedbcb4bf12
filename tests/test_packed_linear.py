"""Linear layers over oneDNN's packed weights: the product against float64, which layers take
it and when their copy is packed again, the choice pinned or measured, and the engine's greedy
tokens against transformers with every linear layer packed."""

from __future__ import annotations

import logging

import pytest
import torch
from test_engine import GREEDY, hf_greedy, prompts, write_checkpoint
from test_small_linear import measured_once, reference
from torch import nn

from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.models import packed_linear, small_linear
from prefixserve.workers.models.layers import CPULayerOps
from prefixserve.workers.models.packed_linear import COUNTS, PackedWeights, linear, pack
from prefixserve.workers.models.quantization import (
    CROSSOVER_ROWS,
    METHODS,
    QuantizedLinear,
    measure_crossover,
)

KERNELS = cpu_kernels()
needs_packing = pytest.mark.skipif(not packed_linear.available(),
                                   reason="this torch build has no oneDNN")


@needs_packing
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_the_packed_product_is_x_times_w_transposed_plus_bias(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for n, k in [(40, 64), (33, 72), (960, 576)]:
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        p = pack(w)
        for m in (1, 5, 33, 200):
            x = torch.randn(m, k, generator=gen).to(dtype)
            for bias in (None, b):
                got = linear(x, p, bias)
                assert got.dtype == dtype and got.shape == (m, n)
                if dtype == torch.float32:
                    # a float sum in another order
                    torch.testing.assert_close(got, reference(x, w, bias), rtol=1e-4, atol=1e-4)
                else:  # the same bf16 product as torch's linear
                    torch.testing.assert_close(got, nn.functional.linear(x, w, bias))


@needs_packing
@pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")
def test_layers_above_the_small_rows_multiply_by_a_copy_packed_again_when_the_weight_changes(
        ) -> None:
    ops = CPULayerOps(KERNELS, small_rows=2, packed=PackedWeights(frozenset({2, 8, 512})))
    layer = nn.Linear(72, 40, bias=True)
    x = torch.randn(600, 72)
    with torch.no_grad():
        assert torch.equal(ops.linear(layer, x[:2]),
                           KERNELS.small_linear(x[:2], layer.weight, layer.bias))
        copy = ops.packed.of(layer)
        for m in (3, 9, 15, 600):  # timed as 2, 8, 8 and 512: packed
            assert torch.equal(ops.linear(layer, x[:m]), linear(x[:m], copy, layer.bias))
            torch.testing.assert_close(ops.linear(layer, x[:m]), layer(x[:m]))
        for m in (4, 16, 511):  # timed as 4, 16 and 256: torch's linear
            assert torch.equal(ops.linear(layer, x[:m]), layer(x[:m]))
        assert ops.packed.of(layer) is copy  # packed once while the weight stands
        strided = x.t().contiguous().t()[:4]  # rows that are not contiguous
        torch.testing.assert_close(ops.linear(layer, strided), layer(strided))
        layer.weight.mul_(2)  # written in place: the copy is stale
        torch.testing.assert_close(ops.linear(layer, x[:9]), layer(x[:9]))
        assert ops.packed.of(layer) is not copy
        layer.weight = nn.Parameter(torch.randn(40, 72))  # replaced
        torch.testing.assert_close(ops.linear(layer, x[:9]), layer(x[:9]))
        other = nn.Linear(72, 40).to(torch.bfloat16)  # rows of another dtype: its forward
        with pytest.raises(RuntimeError):
            other(x[:9])
        with pytest.raises(RuntimeError):
            ops.linear(other, x[:9])
    assert torch.equal(CPULayerOps(KERNELS, small_rows=2).linear(layer, x[:9]), layer(x[:9]))


@needs_packing
@pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")
def test_a_quantized_layer_past_its_packed_rows_multiplies_its_dense_copy_as_a_plain_one_would(
        ) -> None:
    ops = CPULayerOps(KERNELS, small_rows=0, packed=PackedWeights(frozenset({8})))
    layer = QuantizedLinear(nn.Linear(64, 48, bias=True), METHODS["int8"])
    layer.packed_rows = 2
    x = torch.randn(9, 64)
    with torch.no_grad():
        assert torch.equal(ops.linear(layer, x[:2]), layer.forward_packed(x[:2]))
        assert torch.equal(ops.linear(layer, x), linear(x, ops.packed.of(layer), layer.bias))
        assert torch.equal(ops.linear(layer, x[:4]), layer(x[:4]))  # timed as 4: torch's linear
    # the crossover is measured against the dense product it is given
    rows = []

    def dense(q: nn.Module, y: torch.Tensor) -> torch.Tensor:
        rows.append(y.shape[0])
        return ops.dense(q, y)

    _, times = measure_crossover([layer], reps=1, dense=dense)
    assert set(rows) == set(times) and set(times) <= set(CROSSOVER_ROWS)


def test_a_call_takes_the_choice_timed_at_the_largest_count_not_above_its_rows() -> None:
    assert [packed_linear.timed_count(m) for m in (1, 3, 4, 63, 64, 511, 512, 4096)] == [
        1, 2, 4, 32, 64, 256, 512, 512]
    weights = PackedWeights(frozenset({4, 8}))
    assert [m for m in range(1, 20) if weights.covers(m)] == list(range(4, 16))


def test_the_choice_is_pinned_or_measured_once(monkeypatch, caplog) -> None:
    every = frozenset(COUNTS) if packed_linear.available() else frozenset()
    monkeypatch.setenv(packed_linear.ENV, "1")
    assert packed_linear.packed_counts(torch.float32) == every
    monkeypatch.setenv(packed_linear.ENV, "0")
    assert packed_linear.packed_counts(torch.float32) == frozenset()
    monkeypatch.setenv(packed_linear.ENV, "yes")
    with pytest.raises(ValueError, match="must be 1 \\(packed\\) or 0 \\(torch's linear\\), "
                                         "not 'yes'"):
        packed_linear.packed_counts(torch.float32)
    if not packed_linear.available():
        return
    with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
        first = measured_once(monkeypatch, packed_linear,
                              lambda: packed_linear.packed_counts(torch.bfloat16))
    assert first <= every
    assert "bfloat16 linear layers use packed weights at " in caplog.text
    assert "1: " in caplog.text and "512: " in caplog.text  # every count timed


@needs_packing
@pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")
def test_the_engine_over_packed_weights_equals_transformers(tmp_path, monkeypatch) -> None:
    """Every linear layer packed, the LM head included, at every row count: greedy tokens are
    transformers' on the same fp32 weights, with and without prefix hits."""
    monkeypatch.setenv(packed_linear.ENV, "1")
    monkeypatch.setenv(small_linear.ENV, "0")
    model = write_checkpoint(tmp_path, "llama")
    eng = LLMEngine.from_pretrained(tmp_path, EngineConfig(device="cpu", block_size=4,
                                                           num_blocks=128))
    assert isinstance(eng.model.ops, CPULayerOps) and eng.model.ops.packed is not None
    batch = prompts(3, 9, 17, 30, start=5)
    first = eng.generate(batch, GREEDY)
    again = eng.generate(batch, GREEDY)
    assert sum(r.num_cached_tokens for r in again) > 0
    assert len(eng.model.ops.packed._copies) == 2 * 4 + 1  # both layers' four, and the head
    for p, a, b in zip(batch, first, again, strict=True):
        want = hf_greedy(model, p, 8)
        assert a.samples[0].token_ids == want and b.samples[0].token_ids == want
