"""bf16 linear layers over tiles of weights: the product against float64, what the kernel
refuses, which layers take it, the choice pinned or measured, and the engine's bf16 greedy tokens
against transformers in bf16 with every linear layer on tiles. Most need a CPU with AMX or
AVX512-BF16 (whichever engine the build has runs them)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from test_engine import assert_agrees_teacher_forced, prompts, write_checkpoint
from test_small_linear import measured_once, reference
from torch import nn

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.kernels import build
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.models import tile_linear
from prefixserve.workers.models.layers import CPULayerOps
from prefixserve.workers.models.packed_linear import PackedWeights

KERNELS = cpu_kernels()
TILES = KERNELS is not None and KERNELS.tile_linear_engine != ""
needs_tiles = pytest.mark.skipif(not TILES, reason="neither AMX nor AVX512-BF16 in this CPU")
BF16 = torch.bfloat16


def check_tile_linear(kernels) -> None:
    """The product against float64 at whole, ragged, tiny and a model's shapes, every row count's
    passes (also run on the pairs engine built for a CPU without AMX,
    tests/test_attention_kernel.py)."""
    gen = torch.Generator().manual_seed(0)
    # (out, in): whole groups and steps, ragged ones, fewer than one, a model's shape
    for n, k in [(64, 64), (33, 72), (7, 10), (960, 576)]:
        w = torch.randn(n, k, generator=gen).to(BF16)
        b = torch.randn(n, generator=gen).to(BF16)
        packed = kernels.tile_pack(w)
        for m in (1, 5, 16, 17, 32, 33, 64, 70):
            x = torch.randn(m, k, generator=gen).to(BF16)
            for bias in (None, b):
                got = kernels.tile_linear(x, packed, n, bias)
                assert got.dtype == BF16 and got.shape == (m, n)
                # rounded once from a float sum: at most one bf16 step off
                torch.testing.assert_close(got.float(), reference(x, w, bias).float(),
                                           rtol=2**-7, atol=1e-2)
        rows = torch.randn(32, 2 * k, generator=gen).to(BF16)[:, :k]  # strided rows
        assert torch.equal(kernels.tile_linear(rows, packed, n),
                           kernels.tile_linear(rows.contiguous(), packed, n))


@needs_tiles
def test_the_product_is_x_times_w_transposed_plus_bias_at_any_shape() -> None:
    check_tile_linear(KERNELS)


@pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")
def test_the_kernel_refuses_what_it_cannot_read() -> None:
    # the engine is the CPU's: AMX where permitted, else pairs where it has AVX512-BF16
    flags = build._cpu_flags().split()
    assert KERNELS.tile_linear_engine == ("amx" if KERNELS.amx_tiles else
                                          "pairs" if "avx512_bf16" in flags else "")
    w = torch.randn(40, 64).to(BF16)
    if not TILES:
        with pytest.raises(RuntimeError, match="neither AMX-BF16 tiles nor AVX512-BF16 pairs"):
            KERNELS.tile_linear(torch.randn(2, 64).to(BF16), w, 40)
        return
    packed = KERNELS.tile_pack(w)
    with pytest.raises(RuntimeError, match="must be \\[N, K\\] bfloat16"):
        KERNELS.tile_pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="x must be \\[M, K\\] bfloat16"):
        KERNELS.tile_linear(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="x must be \\[M, K\\] bfloat16"):
        KERNELS.tile_linear(torch.randn(0, 64).to(BF16), packed, 40)
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        KERNELS.tile_linear(torch.randn(2, 96).to(BF16), packed, 40)
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        KERNELS.tile_linear(torch.randn(2, 64).to(BF16), packed, 80)
    with pytest.raises(RuntimeError, match="must come from tile_pack"):
        KERNELS.tile_linear(torch.randn(2, 64).to(BF16), w, 40)
    with pytest.raises(RuntimeError, match="bias must be \\[N\\] bfloat16"):
        KERNELS.tile_linear(torch.randn(2, 64).to(BF16), packed, 40, torch.randn(40))


@needs_tiles
def test_layers_at_the_covered_counts_go_on_tiles_and_the_rest_elsewhere() -> None:
    ops = CPULayerOps(KERNELS, small_rows=2,
                      tiles=PackedWeights(frozenset({1, 8}), KERNELS.tile_pack))
    layer = nn.Linear(72, 40, bias=True).to(BF16)
    x = torch.randn(20, 72).to(BF16)
    with torch.no_grad():
        copy_ = ops.tiles.of(layer)
        for m in (1, 8, 15):  # timed as 1, 8 and 8: tiles, before the small-row kernel
            assert torch.equal(ops.linear(layer, x[:m]),
                               KERNELS.tile_linear(x[:m], copy_, 40, layer.bias))
        assert torch.equal(ops.linear(layer, x[:2]),  # timed as 2: the small-row kernel
                           KERNELS.small_linear(x[:2], layer.weight, layer.bias))
        assert torch.equal(ops.linear(layer, x[:16]), layer(x[:16]))  # neither: its forward
        layer.weight.mul_(2)  # written in place: packed again
        torch.testing.assert_close(ops.linear(layer, x[:8]).float(), layer(x[:8]).float(),
                                   rtol=2**-7, atol=1e-2)
        assert ops.tiles.of(layer) is not copy_


@pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")
def test_the_choice_is_pinned_or_measured_once(monkeypatch, caplog) -> None:
    every = frozenset(tile_linear.COUNTS) if TILES else frozenset()
    monkeypatch.setenv(tile_linear.ENV, "1")
    assert tile_linear.tile_counts(KERNELS, BF16, 1, frozenset()) == every
    assert tile_linear.tile_counts(KERNELS, torch.float32, 1, frozenset()) == frozenset()
    monkeypatch.setenv(tile_linear.ENV, "0")
    assert tile_linear.tile_counts(KERNELS, BF16, 1, frozenset()) == frozenset()
    monkeypatch.setenv(tile_linear.ENV, "yes")
    with pytest.raises(ValueError, match="must be 1 \\(tiles\\) or 0 \\(never\\), not 'yes'"):
        tile_linear.tile_counts(KERNELS, BF16, 1, frozenset())
    if not TILES:
        return
    with caplog.at_level(logging.INFO, logger=tile_linear.__name__):
        first = measured_once(monkeypatch, tile_linear,
                              lambda: tile_linear.tile_counts(KERNELS, BF16, 1, frozenset()))
    assert first <= every
    assert f"bfloat16 linear layers run on tiles ({KERNELS.tile_linear_engine}) at " in caplog.text
    assert "1: " in caplog.text and "128: " in caplog.text  # every count timed


@needs_tiles
def test_the_engine_on_tiles_agrees_with_transformers_in_bfloat16(tmp_path, monkeypatch) -> None:
    """Every linear layer on tiles, the LM head included, at every decode row count, with and
    without prefix hits: the low-precision referee's judgement."""
    monkeypatch.setenv(tile_linear.ENV, "1")
    model = write_checkpoint(tmp_path, "llama")
    eng = LLMEngine.from_pretrained(tmp_path, EngineConfig(device="cpu", dtype="bfloat16",
                                                           block_size=4, num_blocks=128))
    assert isinstance(eng.model.ops, CPULayerOps) and eng.model.ops.tiles is not None
    batch = prompts(5, 12, 24, 40, start=11)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    first = eng.generate(batch, params)
    again = eng.generate(batch, params)
    assert sum(r.num_cached_tokens for r in again) > 0
    assert len(eng.model.ops.tiles._copies) == 2 * 4 + 1  # both layers' four, and the head
    hf = copy.deepcopy(model).to(BF16)
    assert_agrees_teacher_forced(hf, batch, first)
    assert_agrees_teacher_forced(hf, batch, again)
