"""GGUF checkpoints: weights, layout and config against transformers' own GGUF loading.

Small random models are written as GGUF the way llama.cpp's converter does (tests/ggufkit.py),
every weight in another quantization, then loaded by the engine and by transformers
(`from_pretrained(dir, gguf_file=...)`): the dequantized tensors must be equal and greedy output
identical. Bad files fail at load with the file and the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from ggufkit import write_gguf

from prefixserve.cluster.cli import main
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.checkpoints import convert_gguf, resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.gguf import GGUFError, GGUFFile
from prefixserve.workers.models.config import load_model_config
from prefixserve.workers.models.loader import load_model

# Widths are multiples of 256 so every weight can take a K-quant (256-value blocks).
SHAPE = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA_QUANTS = {
    "model.embed_tokens.weight": Q.BF16,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
    "model.layers.0.self_attn.k_proj.weight": Q.Q5_K,
    "model.layers.0.self_attn.v_proj.weight": Q.Q6_K,
    "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_0,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.down_proj.weight": Q.F16,
    "model.layers.1.self_attn.q_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_0,
    "lm_head.weight": Q.Q6_K,
}
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [5, 17, 33, 2, 90, 41, 8, 250, 3, 12, 77], [300, 4]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _hf_model(cls: type, **extra: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**SHAPE, **extra)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.08
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    """(arch, gguf path, transformers' model loaded from that GGUF)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        src = _hf_model(transformers.LlamaConfig, num_key_value_heads=2)
        path = write_gguf(folder / "tiny.gguf", src, "llama", LLAMA_QUANTS)
    else:  # MQA, q/k/v biases, tied embeddings, no Q/K permutation in the file
        src = _hf_model(transformers.Qwen2Config, num_key_value_heads=1, tie_word_embeddings=True)
        quants = {"model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
                  "model.layers.1.mlp.down_proj.weight": Q.Q5_K}
        path = write_gguf(folder / "tiny.gguf", src, "qwen2", quants)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=path.name, dtype=torch.float32).eval()
    return request.param, path, hf


def _greedy_hf(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                      min_new_tokens=GREEDY.max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy_engine(path: Path, **engine: object) -> list[list[int]]:
    config = EngineConfig(num_blocks=64, block_size=4, model_fingerprint="t", **engine)
    outs = LLMEngine.from_pretrained(path, config).generate(PROMPTS, GREEDY)
    return [o.samples[0].token_ids for o in outs]


def test_dequantized_tensors_equal_transformers(case) -> None:
    _, path, hf = case
    ref = hf.state_dict()
    seen = set()
    for name, tensor in GGUFFile(path).iter_tensors():
        assert torch.equal(tensor, ref[name].float()), name
        seen.add(name)
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert seen | tied == set(ref)


def test_config_comes_from_the_metadata(case) -> None:
    arch, path, hf = case
    c = GGUFFile(path).config
    hc = hf.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (256, 512, 2)
    assert (c.num_attention_heads, c.num_key_value_heads) == (4, hc.num_key_value_heads)
    assert c.head_dim == 64 and c.vocab_size == 320 and c.max_model_len == 256
    assert c.attention_bias == (arch == "qwen2") and c.tie_word_embeddings == (arch == "qwen2")
    assert c.eos_token_ids == (1,) and c.bos_token_id == 0


def test_greedy_output_equals_transformers(case) -> None:
    _, path, hf = case
    expected = [_greedy_hf(hf, p) for p in PROMPTS]
    assert _greedy_engine(path) == expected
    # chunked prefill: a 3-token budget splits every prompt
    assert _greedy_engine(path, max_num_batched_tokens=3) == expected


def test_converted_directory_serves_the_same_weights(case, tmp_path: Path) -> None:
    _, path, hf = case
    folder = resolve_checkpoint(str(path), cache_dir=tmp_path)
    assert folder.parent == tmp_path and folder.name.startswith("gguf-")
    assert load_model_config(folder) == GGUFFile(path).config
    direct, converted = load_model(path), load_model(folder)
    for (name, a), (_, b) in zip(direct.state_dict().items(), converted.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    # transformers reads the converted directory as an ordinary checkpoint of its architecture
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert _greedy_hf(plain.eval(), PROMPTS[1]) == _greedy_hf(hf, PROMPTS[1])
    # a second resolve reuses the directory: nothing is written again
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(path, tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    src = _hf_model(transformers.LlamaConfig, num_key_value_heads=2)
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", src)


def _bad_files(good: Path, folder: Path) -> dict[str, tuple[Path, str]]:
    truncated = folder / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    src = _hf_model(transformers.LlamaConfig, num_key_value_heads=2)
    other = write_gguf(folder / "other-arch.gguf", src, "gemma")
    q5 = write_gguf(folder / "q5_0.gguf", src, "llama",
                    {"model.layers.1.mlp.up_proj.weight": Q.Q5_0})
    return {
        "truncated": (truncated, "not a readable GGUF file"),
        "architecture": (other, "unsupported architecture 'gemma'"),
        "quantization": (q5, "blk.1.ffn_up.weight has unsupported quantization Q5_0"),
    }


@pytest.mark.parametrize("kind", ["truncated", "architecture", "quantization"])
def test_bad_files_fail_at_load_naming_the_file_and_reason(
    kind: str, good_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path, reason = _bad_files(good_gguf, tmp_path)[kind]
    with pytest.raises(GGUFError) as err:
        LLMEngine.from_pretrained(path, EngineConfig(num_blocks=8, model_fingerprint="t"))
    assert str(path) in str(err.value) and reason in str(err.value)
    # the CLI stops before starting anything, with the same one-line reason
    os.environ["PREFIXSERVE_CACHE"] = str(tmp_path / "cache")
    try:
        assert main(["serve", "--model", str(path), "--policy", "pow2"]) == 2
    finally:
        del os.environ["PREFIXSERVE_CACHE"]
    err_text = capsys.readouterr().err
    assert reason in err_text and str(path) in err_text
    cache = tmp_path / "cache"  # nothing half-written is left behind
    assert not cache.exists() or not list(cache.iterdir())
