"""The two registries: architecture -> model class (and config quirks), device -> attention
backend. Unknown names fail with a message naming them; registering is one entry."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from prefixserve.router.index_stores import INDEX_STORES
from prefixserve.router.registry import Registry
from prefixserve.router.routing_policies import ROUTING_POLICIES
from prefixserve.workers.attention.cpu_paged import CPUPagedBackend
from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.attention.registry import BACKEND_ENV, BACKENDS, backend_for
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend
from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.kv_tensor import allocate_kv_cache
from prefixserve.workers.model_sources import (
    MODEL_SOURCES,
    CheckpointSource,
    SimSource,
    model_source,
)
from prefixserve.workers.models.config import parse_config
from prefixserve.workers.models.llama import LlamaForCausalLM
from prefixserve.workers.models.loader import architecture_class, build_model
from prefixserve.workers.models.registry import (
    ARCHITECTURES,
    Architecture,
    get_architecture,
    gguf_architecture,
)
from prefixserve.workers.sim.profiles import H100_LLAMA3_8B, PROFILES

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def random_weights(config) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors, HF-named, shaped by the model's own weight map."""
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        slots = LlamaForCausalLM(config).weight_map()
    out = {}
    for name, slot in slots.items():
        shape = slot.param.shape if slot.rows is None else slot.param[slot.rows].shape
        out[name] = 0.2 * torch.randn(shape, generator=gen)
    return out


def test_unknown_architecture_is_named_with_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        get_architecture("GPT2LMHeadModel")
    assert "'GPT2LMHeadModel'" in str(err.value)
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in str(err.value)
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel'"):
        parse_config({"architectures": ["GPT2LMHeadModel"], **TINY})
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'; supported: llama, qwen2$"):
        gguf_architecture("gpt2")


def test_llama_variants_share_one_class_and_differ_in_config() -> None:
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert architecture_class(get_architecture(name)) is LlamaForCausalLM
    assert gguf_architecture("qwen2").name == "Qwen2ForCausalLM"
    assert gguf_architecture("llama").gguf_qk_permuted
    assert not gguf_architecture("qwen2").gguf_qk_permuted
    windowed = {**TINY, "sliding_window": 16}
    assert parse_config({"architectures": ["Qwen2ForCausalLM"], **windowed}).attention_bias
    assert parse_config({"architectures": ["Qwen2ForCausalLM"], **windowed}).sliding_window is None
    assert parse_config({"architectures": ["MistralForCausalLM"], **windowed}).sliding_window == 16


def test_an_architecture_is_added_by_one_registry_entry(monkeypatch) -> None:
    entry = Architecture("MyLlamaForCausalLM", "myllama", "llama", "LlamaForCausalLM",
                         qkv_bias=True)
    monkeypatch.setitem(ARCHITECTURES, entry.name, entry)
    config = parse_config({"model_type": "myllama", **TINY})
    assert config.architecture == "MyLlamaForCausalLM" and config.attention_bias
    weights = random_weights(config)
    model = build_model(config, iter(weights.items()))
    assert type(model) is LlamaForCausalLM
    v_width = config.num_key_value_heads * config.head_dim  # v comes last in the fused bias
    v_bias = model.layers[1].self_attn.qkv_proj.bias[-v_width:]
    assert torch.equal(v_bias, weights["model.layers.1.self_attn.v_proj.bias"])


def test_configs_and_fingerprints_are_read_without_torch() -> None:
    code = (
        "import sys\n"
        "from workers.checkpoints import checkpoint_fingerprint\n"
        "from workers.models.config import parse_config\n"
        f"raw = {{'architectures': ['Qwen2ForCausalLM'], **{TINY!r}}}\n"
        "assert parse_config(raw).attention_bias\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_is_chosen_by_device_type(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    cpu = CPUPagedBackend if cpu_kernels() is not None else TorchSDPABackend
    assert type(backend_for("cpu")) is cpu
    assert type(backend_for(torch.device("cuda", 1))) is TorchSDPABackend  # the default

    class OtherBackend(TorchSDPABackend):
        pass

    monkeypatch.setitem(BACKENDS, "cuda", OtherBackend)
    assert type(backend_for("cuda:0")) is OtherBackend
    assert type(backend_for("cpu")) is cpu


def test_the_backend_env_var_forces_one_by_name(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch_sdpa")
    assert type(backend_for("cpu")) is TorchSDPABackend
    monkeypatch.setenv(BACKEND_ENV, "flashinfer")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flashinfer' \(known: "
                       r"torch_sdpa, cpu_paged\)"):
        backend_for("cpu")


def test_the_model_attends_through_the_backend_registered_for_its_device(monkeypatch) -> None:
    config = parse_config({"architectures": ["LlamaForCausalLM"], **TINY})
    weights = random_weights(config)
    calls: list[int] = []

    class CountingBackend(TorchSDPABackend):
        def forward(self, q, k, v, k_cache, v_cache, meta, scale):
            calls.append(q.shape[0])
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)

    def run(model) -> torch.Tensor:
        meta = AttentionMetadata.build([5], [5], [[3, 1]], 4)
        cache = allocate_kv_cache(config, 4, 4, torch.float32, "cpu")
        return model(torch.arange(5), meta.positions(), meta, cache)

    want = run(build_model(config, iter(weights.items())))
    monkeypatch.setitem(BACKENDS, "cpu", CountingBackend)
    model = build_model(config, iter(weights.items()))
    assert isinstance(model.attention, CountingBackend)
    assert torch.equal(run(model), want)
    assert calls == [5] * config.num_hidden_layers


def test_a_model_name_finds_its_source_and_a_sim_profile_answers_for_itself() -> None:
    assert isinstance(model_source("sim:cpu-smollm2"), SimSource)
    for name in ("prefixserve-tiny", "/models/llama", "smollm2-135m-instruct", "simple"):
        assert isinstance(model_source(name), CheckpointSource), name
    sim = model_source("sim:h100-llama3-8b")
    assert sim.check("sim:h100-llama3-8b") == "sim:h100-llama3-8b"
    with pytest.raises(ValueError, match=r"no simulation profile 'nope' \(known: sim:"):
        sim.check("sim:nope")
    path = sim.tokenizer_path("sim:h100-llama3-8b")  # the sim tokenizer's checkpoint
    assert sim.limits("sim:h100-llama3-8b", path) == (H100_LLAMA3_8B.max_model_len,
                                                      H100_LLAMA3_8B.served_vocab_size)
    assert sim.fingerprint("sim:h100-llama3-8b") == H100_LLAMA3_8B.fingerprint
    assert sim.served_name("sim:h100-llama3-8b") == "sim-h100-llama3-8b"
    checkpoint = model_source("prefixserve-tiny")
    assert checkpoint.check("prefixserve-tiny") == "prefixserve-tiny"
    with pytest.raises(ValueError, match="known model"):
        checkpoint.check("no-such-model-anywhere")


def test_every_variation_point_has_the_one_registry_shape() -> None:
    for registry in (ROUTING_POLICIES, INDEX_STORES, ARCHITECTURES, BACKENDS, MODEL_SOURCES,
                     PROFILES):
        assert isinstance(registry, Registry) and registry.names() == tuple(registry)
    plain = Registry("widget", {"a": 1, "b": 2})
    assert plain.lookup("b") == 2
    with pytest.raises(ValueError, match=r"^unknown widget 'c' \(known: a, b\)$"):
        plain.lookup("c")
    with pytest.raises(ValueError, match="unknown widget 3"):
        plain.lookup(3)  # not a name at all
    assert Registry("widget", {"a": 1}, default=0).lookup("zz") == 0
    custom = Registry("widget", {"a": 1}, unknown=lambda n, known: KeyError((n, known)))
    with pytest.raises(KeyError, match=r"\('x', \('a',\)\)"):
        custom.lookup("x")
