"""LoRA adapters in the engine against transformers + PEFT on the same random weights (fp32,
CPU): greedy tokens per adapter in one mixed batch with the base model, with prefix hits,
chunked prefill and preemption; each adapter's blocks its own; bad adapters refused with their
reason and nothing loaded; an adapter removed while in use lets its requests finish."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.lora import AdapterError

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5)
ADAPTERS = {  # name: (rank, alpha, target modules, rsLoRA)
    "all": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            False),
    "qv-down": (8, 16, ["q_proj", "v_proj", "down_proj"], True),
    "mlp-o": (2, 4, ["gate_proj", "up_proj", "o_proj"], False),
}
NEW_TOKENS = 8


def _randomize(model: torch.nn.Module, seed: int, only: str = "") -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only not in name:
                continue
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def _adapter(base: torch.nn.Module, name: str, folder: Path, seed: int) -> torch.nn.Module:
    """A PEFT model with random LoRA weights (B too, so it changes the output), saved."""
    rank, alpha, targets, rslora = ADAPTERS[name]
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
        use_rslora=rslora)).eval()
    _randomize(model, seed, only="lora_")
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], dict]:
    """The base checkpoint, each adapter's folder, and each reference model (None: base)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().eval()
    _randomize(hf, 0)
    root = tmp_path_factory.mktemp("lora")
    hf.save_pretrained(root / "base")
    folders, refs = {}, {None: hf}
    for i, name in enumerate(ADAPTERS):
        folders[name] = root / name
        refs[name] = _adapter(hf, name, folders[name], seed=i + 1)
    return root / "base", folders, refs


def _greedy(model: torch.nn.Module, prompt: list[int], new: int = NEW_TOKENS) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()


def _engine(base: Path, folders: dict[str, Path], **config: object) -> LLMEngine:
    eng = LLMEngine.from_pretrained(base, EngineConfig(device="cpu", block_size=4, **config))
    for name, folder in folders.items():
        eng.add_lora(name, folder)
    return eng


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
MIX: list[str | None] = ["all", "qv-down", None, "mlp-o", "all"]


@pytest.mark.parametrize(("config", "new"), [
    ({}, NEW_TOKENS),
    ({"max_num_batched_tokens": 12}, NEW_TOKENS),  # chunked prefill: prompts split in steps
    ({"num_blocks": 16}, 24),  # outputs outgrow the pool: preemption by recompute
    ({"max_loras": 1, "max_cpu_loras": 1}, NEW_TOKENS),  # one slot, one host copy: churn
], ids=["plain", "chunked", "preempted", "one-slot"])
def test_a_mixed_batch_matches_peft_per_adapter(models: tuple, config: dict, new: int) -> None:
    base, folders, refs = models
    eng = _engine(base, folders, **config)
    prompts = [_prompt(20 + 3 * i, seed=i) for i in range(len(MIX))]
    expected = [_greedy(refs[name], p, new) for name, p in zip(MIX, prompts, strict=True)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params, lora=MIX)
    assert [o.samples[0].token_ids for o in outs] == expected
    # again: prefix hits under each adapter give the same tokens
    again = eng.generate(prompts, params, lora=MIX)
    assert [o.samples[0].token_ids for o in again] == expected
    if "num_blocks" in config:
        assert eng.scheduler.num_preemptions > 0
    else:
        assert all(o.num_cached_tokens >= 16 for o in again)
    if "max_loras" in config:  # every adapter was loaded, evicted and read back
        lora = eng.stats().lora
        assert lora.evictions >= 5 and lora.loads == lora.evictions + 1 and lora.reads >= 5
    assert expected[0] != expected[2]  # the adapters do change the answer


def test_each_adapter_has_its_own_cache_entries(models: tuple) -> None:
    """The same prompt under two adapters (and the base model): no hit across them, a hit
    within each."""
    base, folders, _ = models
    eng = _engine(base, folders)
    prompt = _prompt(33, seed=9)
    for name in ("all", "qv-down", None):
        first = eng.generate([prompt], GREEDY, lora=name)[0]
        assert first.num_cached_tokens == 0, name
        second = eng.generate([prompt], GREEDY, lora=name)[0]
        assert second.num_cached_tokens == 32, name
        assert second.samples[0].token_ids == first.samples[0].token_ids
    assert eng.namespace(None, eng.lora("all").identity) != eng.namespace(None)
    assert eng.namespace("salt", eng.lora("all").identity) != eng.namespace("salt")


def _broken(folders: dict[str, Path], root: Path, how: str) -> Path:
    folder = root / how
    shutil.copytree(folders["all"], folder)
    if how == "missing-weights":
        (folder / "adapter_model.safetensors").unlink()
    elif how == "missing-config":
        (folder / "adapter_config.json").unlink()
    elif how == "dora":
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    return folder


def test_bad_adapters_are_refused_with_the_reason(models: tuple, tmp_path: Path) -> None:
    base, folders, _ = models
    eng = _engine(base, {}, max_lora_rank=4)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**TINY, "hidden_size": 32, "intermediate_size": 48})).eval()
    _adapter(other, "all", tmp_path / "other-base", seed=5)
    cases = [
        (tmp_path / "other-base", "an adapter of another base model"),
        (folders["qv-down"], "rank 8 is over this server's max_lora_rank 4"),
        (_broken(folders, tmp_path, "missing-weights"), "adapter_model.safetensors is missing"),
        (_broken(folders, tmp_path, "missing-config"), "adapter_config.json is missing"),
        (_broken(folders, tmp_path, "dora"), "unsupported adapter settings: use_dora"),
    ]
    for folder, reason in cases:
        with pytest.raises(AdapterError, match=reason):
            eng.add_lora("x", folder)
        assert (eng.lora_store.known, eng.lora_store.host) == ({}, {})  # nothing loaded
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'x'") as info:
        eng.generate([[1, 2, 3]], GREEDY, lora="x")
    assert info.value.param == "model"


def test_removing_an_adapter_lets_its_requests_finish(models: tuple) -> None:
    base, folders, refs = models
    eng = _engine(base, {"all": folders["all"]})
    prompt = _prompt(21, seed=4)
    eng.add_request("r", prompt, GREEDY, lora=eng.lora("all"))
    eng.add_request("base", prompt, GREEDY)
    assert (eng.stats().running_loras, eng.stats().waiting_loras) == ((), ("all",))
    tokens: list[int] = []
    for out in eng.step():
        tokens += out.new_token_ids if out.request_id == "r" else []
    assert eng.stats().running_loras == ("all",) and eng.stats().lora.registered == 1
    eng.remove_lora("all")
    with pytest.raises(InvalidRequestError):
        eng.lora("all")  # no new requests under it
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids if out.request_id == "r" else []
    assert tokens == _greedy(refs["all"], prompt)
    assert eng.stats().lora.registered == 0
    eng.lora_store.prefetch("all", str(folders["all"]))  # a later read: the host copy went
    assert eng.stats().lora.reads == 2
