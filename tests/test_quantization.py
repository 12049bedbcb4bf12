"""Weight-only int4/int8 quantization: the packing against its formula and the kernels, the
layer's two paths, the model swap, and the engine against transformers on the same
dequantized weights (exact on the dense path; top-1 and logprobs on the packed one)."""

import copy
import itertools

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from pydantic import ValidationError
from test_engine import (
    GREEDY,
    assert_agrees_teacher_forced,
    hf_greedy,
    prompts,
    write_checkpoint,
)
from test_kv_tiers import engine as tiered_engine
from test_kv_tiers import settle
from test_lora import GREEDY as LORA_GREEDY
from test_lora import MIX
from test_lora import _engine as lora_engine
from test_lora import _greedy as lora_greedy
from test_lora import _prompt as lora_prompt
from test_lora import models as lora_models  # noqa: F401 (a fixture: base and adapters)

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.models.quantization import (
    CROSSOVER_ROWS,
    INT4_GROUP,
    INT4_KERNEL_ENV,
    METHODS,
    QuantizedLinear,
    int4_method,
    int4_rows_method,
    measure_crossover,
    pack_int4,
    pack_int4_rows,
    pack_int8,
    quantize_model,
)

KERNELS = cpu_kernels()
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels")


def kernel_weight(layer: QuantizedLinear) -> torch.Tensor:
    """The weight the packed kernel multiplies by, read back through it: identity @ W^T."""
    eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
    return layer.method.matmul(eye, layer.packed, layer.scales).float().t()


def linear(out_f: int, in_f: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(torch.linspace(0.2, 5.0, in_f))  # groups of very different ranges
        layer.weight[3, :INT4_GROUP] = 0.75  # one constant group
    return layer


def test_int4_groups_span_their_range_within_half_a_step() -> None:
    w = linear(48, 128).weight.detach()
    packed, scales, dense = pack_int4(w)
    assert packed.dtype == torch.uint8 and scales.shape == (128 // INT4_GROUP, 48, 2)
    s = scales[..., 0].float().t().repeat_interleave(INT4_GROUP, 1)
    z = scales[..., 1].float().t().repeat_interleave(INT4_GROUP, 1)
    q = (dense - z) / s + 8
    assert torch.equal(q, q.round()) and q.min() >= 0 and q.max() <= 15
    # each group's min lands on q = 0 and its max on q = 15, give or take the bf16 zero's rounding
    err = (w - dense).abs()
    assert (err <= s / 2 + z.abs() * 2**-8 + 1e-6).all()
    assert float(err.mean()) < float(s.mean()) / 3
    assert torch.allclose(dense[3, :INT4_GROUP], torch.full((INT4_GROUP,), 0.75), atol=4e-3)


def test_int4_keeps_a_q4_1_gguf_weight_to_its_level() -> None:
    """GGUF's Q4_1 has int4's shape (32 values, a scale and a min): packing a weight that a
    Q4_1 file holds moves no value to another level, only by the bf16 rounding of its group's
    scale and offset (the file's are fp16). So `--quantization int4` on a Q4_1 GGUF serves
    the file's own weights."""
    w = linear(48, 128).weight.detach().numpy()
    q41 = torch.from_numpy(quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q4_1),
                                             GGMLQuantizationType.Q4_1))
    _, scales, dense = pack_int4(q41)
    step = scales[..., 0].float().t().repeat_interleave(INT4_GROUP, 1)
    assert float(((dense - q41).abs() / step).max()) < 0.1
    assert float(((dense - torch.from_numpy(w)).abs() / step).max()) > 0.4  # w itself moved


def test_int8_rows_are_symmetric_within_half_a_step() -> None:
    w = linear(48, 100).weight.detach()
    packed, scales, dense = pack_int8(w)
    assert packed.dtype == torch.int8 and scales.shape == (48,)
    assert int(packed.abs().max()) == 127  # the row's largest magnitude uses the whole range
    assert torch.equal(dense, packed.float() * scales.float()[:, None])
    assert ((w - dense).abs() <= scales.float()[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_the_kernel_multiplies_by_the_dense_copy(name) -> None:
    layer = QuantizedLinear(linear(64, 96, bias=True), METHODS[name])
    assert torch.allclose(kernel_weight(layer), layer.weight, atol=2e-2, rtol=1e-2)
    x = torch.randn(5, 96)
    layer.packed_rows = 4  # 5 rows: the dense copy, exactly
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    layer.packed_rows = 8  # the packed kernel, bf16 activations, the bias added
    y = layer(x)
    assert y.dtype == torch.float32
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.allclose(y, ref, atol=0.15, rtol=0.02)
    assert not torch.equal(y, ref)


@needs_kernel
def test_the_int4_kernel_multiplies_float_rows_by_the_dense_copy() -> None:
    check_int4_linear(KERNELS)


def check_int4_linear(kernels) -> None:
    """prefixserve's int4 kernel keeps the activations' dtype: fp32 rows give the dense
    product but for the order of its sums, at every row count (tiles of four and the rest), and
    bf16 rows (through pair products with AVX512-BF16) the product rounded to bf16.
    Also run on the kernels built for narrower vectors (tests/test_attention_kernel.py)."""
    method = int4_rows_method(kernels)
    layer = QuantizedLinear(linear(64, 96, bias=True), method)
    assert torch.equal(layer.weight, pack_int4(linear(64, 96).weight)[2])  # torch's levels
    packed, scales, _ = pack_int4_rows(linear(64, 96).weight)
    assert packed.shape == (64, 48) and scales.shape == (64, 3, 2)
    assert layer.packed_bytes() == 64 * 48 + 64 * 3 * 2 * 4
    for rows in (1, 3, 4, 5, 9):
        x = torch.randn(rows, 96)
        ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.allclose(layer.forward_packed(x), ref, atol=1e-5, rtol=1e-5)
        y16 = layer.forward_packed(x.bfloat16())
        assert y16.dtype == torch.bfloat16
        assert torch.allclose(y16.float(), ref, atol=0.1, rtol=0.02)
        # the same rows in float: the only difference left is y's rounding to bf16
        ref16 = torch.nn.functional.linear(x.bfloat16().float(), layer.weight, layer.bias)
        assert torch.allclose(y16.float(), ref16, atol=1e-2, rtol=8e-3)
    x = torch.randn(2, 96)
    for bad in ((x[:, :80], packed, scales), (x.half(), packed, scales),
                (x, packed.int(), scales), (x, packed, scales.bfloat16()),
                (x, packed[:, :40], scales), (x, packed, scales[:, :2])):
        with pytest.raises(RuntimeError, match="int4_linear"):
            kernels.int4_linear(*bad)


def test_the_int4_kernel_is_pinned_or_measured(monkeypatch) -> None:
    monkeypatch.setenv(INT4_KERNEL_ENV, "torch")
    assert int4_method() is METHODS["int4"]
    monkeypatch.setenv(INT4_KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="torch or prefixserve"):
        int4_method()
    if KERNELS is None:
        return
    monkeypatch.setenv(INT4_KERNEL_ENV, "prefixserve")
    assert int4_method().kernel == "prefixserve"
    monkeypatch.delenv(INT4_KERNEL_ENV)
    measured = int4_method().kernel
    assert measured in ("torch", "prefixserve") and int4_method().kernel == measured
    line = quantize_model(tiny_model(), "int4", packed_rows=1)
    assert f"{measured}'s kernel" in line


def tiny_model(widths=(64, 80, 32, 24)) -> torch.nn.Module:
    """Linear layers from each width to the next (after an embedding of the first)."""
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return torch.nn.Sequential(torch.nn.Embedding(10, widths[0]),
                               torch.nn.Sequential(*layers)).eval()


def test_quantize_model_swaps_the_layers_it_can_pack() -> None:
    """Only widths the kernels take are packed: on others they crash the process (int4:
    inputs of 32s, outputs of 16s; int8: inputs of 16s)."""
    model = tiny_model()
    before = model[1][0].weight.detach().clone()
    line = quantize_model(model, "int4", packed_rows=3)
    first, second, third = model[1]
    assert isinstance(first, QuantizedLinear) and first.packed_rows == 3
    assert type(second) is torch.nn.Linear  # 80 inputs: not a multiple of 32
    assert type(third) is torch.nn.Linear  # 24 outputs: not a multiple of 16
    assert "1 linear layers packed" in line and "up to 3 rows" in line
    assert "2 kept dense (it packs inputs a multiple of 32, outputs a multiple of 16)" in line
    assert torch.equal(first.weight, pack_int4(before)[2])
    scale_bytes = 4 if first.method.kernel == "prefixserve" else 2  # (scale, offset) a group
    assert first.packed_bytes() == 80 * 64 // 2 + 2 * 80 * 2 * scale_bytes
    int8 = tiny_model((64, 80, 24, 7))
    line = quantize_model(int8, "int8", packed_rows=0)
    assert "2 linear layers packed" in line and "1 kept dense (it packs inputs a multiple of 16)" \
        in line
    assert type(int8[1][2]) is torch.nn.Linear  # 24 inputs
    assert isinstance(int8[1][1], QuantizedLinear)  # 24 outputs are fine for int8
    assert int8[1][1](torch.randn(2, 80)).shape == (2, 24)


def test_quantize_model_refuses_what_it_cannot_run() -> None:
    with pytest.raises(UnsupportedModelError, match="no linear layer of this model has widths"):
        quantize_model(tiny_model((48, 80)), "int4", packed_rows=1)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize_model(tiny_model(), "int3")
    with torch.device("meta"):
        on_meta = tiny_model()
    with pytest.raises(UnsupportedModelError, match="CPU only, not meta"):
        quantize_model(on_meta, "int4")
    with pytest.raises(ValidationError):
        EngineConfig(quantization="int3")


def test_the_crossover_is_where_dense_first_wins() -> None:
    model = tiny_model((256, 512, 256))
    line = quantize_model(model, "int4")  # measured
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    rows = layers[0].packed_rows
    assert all(m.packed_rows == rows for m in layers) and "measured" in line
    best, times = measure_crossover(layers, reps=1)
    tried = list(times)
    assert tried == list(CROSSOVER_ROWS[: len(tried)])
    assert all(times[m][0] < times[m][1] for m in tried if m <= best)
    if best != CROSSOVER_ROWS[-1]:
        assert times[tried[-1]][0] >= times[tried[-1]][1]  # it stopped where dense won


# ------------------------------------------------------------------ the engine, refereed


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, write_checkpoint(path, "llama")


def quantized_reference(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """transformers' (or PEFT's) model with each linear weight the engine quantizes replaced by
    its dequantized copy: those the method packs, not a LoRA adapter's own."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for module_name, m in ref.named_modules():
            if (isinstance(m, torch.nn.Linear) and "lora_" not in module_name
                    and METHODS[name].packs(m)):
                m.weight.copy_(METHODS[name].pack(m.weight)[2])
    return ref


def quantized_engine(path, name: str, packed_rows: int, **kw) -> LLMEngine:
    eng = LLMEngine.from_pretrained(path, EngineConfig(
        device="cpu", block_size=4, num_blocks=128, quantization=name, **kw))
    layers = [m for m in eng.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 + 1  # every projection of both layers, and the LM head
    for m in layers:
        m.packed_rows = packed_rows
    return eng


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_dense_path_equals_transformers_on_the_dequantized_weights(llama, name) -> None:
    path, model = llama
    ref = quantized_reference(model, name)
    eng = quantized_engine(path, name, packed_rows=0)
    batch = prompts(3, 9, 17, 30, start=5)
    first = eng.generate(batch, GREEDY)
    again = eng.generate(batch, GREEDY)  # prefix hits
    assert sum(r.num_cached_tokens for r in again) > 0
    for p, a, b in zip(batch, first, again, strict=True):
        want = hf_greedy(ref, p, 8)
        assert a.samples[0].token_ids == want and b.samples[0].token_ids == want
    if name == "int4":  # it moved the model: not all of these are the unquantized tokens
        assert any(hf_greedy(ref, p, 8) != hf_greedy(model, p, 8) for p in batch)


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_packed_path_agrees_with_transformers_on_the_dequantized_weights(llama, name) -> None:
    """Packed kernels run bf16 activations: judged as the bf16 referee is, by transformers'
    top-1 (teacher-forced on the engine's tokens) and logprobs, with and without prefix hits."""
    path, model = llama
    ref = quantized_reference(model, name)
    eng = quantized_engine(path, name, packed_rows=64)
    batch = prompts(5, 12, 24, 40, start=11)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    results = eng.generate(batch, params) + eng.generate(batch, params)
    assert sum(r.num_cached_tokens for r in results[len(batch):]) > 0
    assert_agrees_teacher_forced(ref, batch + batch, results)


@needs_kernel
def test_the_int4_kernel_path_equals_transformers_on_the_dequantized_weights(
        llama, monkeypatch) -> None:
    """prefixserve's int4 kernel keeps fp32 activations: its greedy tokens are transformers'
    on the dequantized weights, exactly as the dense path's, with and without prefix hits."""
    monkeypatch.setenv(INT4_KERNEL_ENV, "prefixserve")
    path, model = llama
    ref = quantized_reference(model, "int4")
    eng = quantized_engine(path, "int4", packed_rows=64)
    assert all(m.method.kernel == "prefixserve" for m in eng.model.modules()
               if isinstance(m, QuantizedLinear))
    batch = prompts(3, 9, 17, 30, start=5)
    first = eng.generate(batch, GREEDY)
    again = eng.generate(batch, GREEDY)
    assert sum(r.num_cached_tokens for r in again) > 0
    for p, a, b in zip(batch, first, again, strict=True):
        want = hf_greedy(ref, p, 8)
        assert a.samples[0].token_ids == want and b.samples[0].token_ids == want


def test_quantized_kv_is_kept_apart_on_disk(tmp_path) -> None:
    """A disk tier's blocks were computed by its model's weights: quantized weights compute
    other KV, so they get a folder of their own, and a restart in the same mode finds its own."""
    path = tmp_path / "ckpt"
    model = write_checkpoint(path, "llama")
    disk = tmp_path / "kv"
    prompt = prompts(40, start=3)[0]
    for quantization in ("none", "int4"):
        eng = tiered_engine(path, disk=disk, quantization=quantization)
        assert not eng.tiers.disk.files
        eng.generate([prompt], GREEDY)
        settle(eng)
        assert eng.tiers.disk.files
        eng.tiers.close()
    plain = tiered_engine(path, disk=disk)
    assert plain.tiers.disk.files
    (warm,) = plain.generate([prompt], GREEDY)
    assert warm.num_cached_tokens == 36  # all but the last block, computed for its logits
    assert warm.samples[0].token_ids == hf_greedy(model, prompt, 8)
    plain.tiers.close()


def test_lora_adapters_run_over_quantized_layers(lora_models) -> None:  # noqa: F811
    """An adapter adds to a quantized projection's output as to a dense one's: on the dense
    path, a mixed batch's greedy tokens per adapter are PEFT's over the dequantized base."""
    base, folders, refs = lora_models
    eng = lora_engine(base, folders, quantization="int4")
    layers = [m for m in eng.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 3  # down_proj's 112 inputs and the LM head's 300 outputs: dense
    for m in layers:
        m.packed_rows = 0
    prompts_ = [lora_prompt(20 + 3 * i, seed=i) for i in range(len(MIX))]
    expected = [lora_greedy(quantized_reference(refs[name], "int4"), p)
                for name, p in zip(MIX, prompts_, strict=True)]
    outs = eng.generate(prompts_, LORA_GREEDY, lora=MIX)
    assert [o.samples[0].token_ids for o in outs] == expected
    assert expected[0] != expected[2]
