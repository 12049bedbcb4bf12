"""The model side against Hugging Face transformers on the same tiny random weights (fp32, CPU).

Our model is driven directly with hand-built AttentionMetadata and a paged KV cache whose block
ids are deliberately non-contiguous, so every test also checks the paged reads and writes.
"""

import copy
import json
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from prefixserve.workers.attention.cpu_paged import CPUPagedBackend
from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend, sdpa_plan
from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.kv_tensor import allocate_kv_cache, copy_blocks, kv_bytes_per_token
from prefixserve.workers.models.config import load_model_config, parse_config
from prefixserve.workers.models.layers import CPULayerOps, LayerOps
from prefixserve.workers.models.loader import load_model

BS = 4  # small blocks so short prompts span many of them
ATOL = 1e-4
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    # GQA 4:2 with llama3 RoPE scaling (short original length so scaling bites at our lengths).
    "llama": (transformers.LlamaConfig, dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    # MQA, q/k/v bias, tied embeddings.
    "qwen2": (transformers.Qwen2Config, dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # head_dim from config (not hidden/heads), saved as a sharded checkpoint.
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=2, head_dim=24)),
}


def _randomize(model: torch.nn.Module) -> None:
    """Weights large enough that a wrong position, head or mask moves logits by far over ATOL."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


# Every test runs against HF both ways a CPU can compute: all in torch (SDPA attention, torch's
# norms, RoPE, activation and matmuls: what other devices run), and all in the CPU kernels (paged
# decode attention, fused layer ops, every linear layer at up to 8 rows through the small-row
# kernel, whatever this machine measured) where this machine builds them.
COMPUTE = {"torch": lambda: (TorchSDPABackend(), LayerOps())}
if cpu_kernels() is not None:
    COMPUTE["cpu_kernels"] = lambda: (CPUPagedBackend(cpu_kernels()),
                                      CPULayerOps(cpu_kernels(), small_rows=8))


@pytest.fixture(scope="module", params=list(COMPUTE))
def compute(request):
    return request.param


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory, compute):
    cfg_cls, extra = CASES[request.param]
    config = cfg_cls(**TINY, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    shard = "60KB" if request.param == "mistral" else "1GB"
    hf.save_pretrained(path, max_shard_size=shard)
    if request.param == "mistral":
        assert (path / "model.safetensors.index.json").exists()
    ours = load_model(path, dtype="float32", device="cpu")
    ours.attention, ours.ops = COMPUTE[compute]()
    return request.param, path, hf, ours


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


class Paged:
    """A KV cache plus the bookkeeping a scheduler would do, to drive the model by hand."""

    def __init__(self, model, num_blocks: int = 256):
        self.model = model
        self.cache = allocate_kv_cache(model.config, num_blocks, BS, torch.float32, "cpu")

    def step(self, seqs: list[tuple[list[int], int, list[int]]], all_logits: bool = False):
        """seqs: (new tokens, context length after the step, block table) per sequence."""
        q_lens = [len(t) for t, _, _ in seqs]
        logits_idx = list(range(sum(q_lens))) if all_logits else None
        meta = AttentionMetadata.build(
            q_lens, [c for _, c, _ in seqs], [b for _, _, b in seqs], BS, logits_idx
        )
        ids = torch.tensor([t for toks, _, _ in seqs for t in toks])
        self.meta = meta
        return self.model(ids, meta.positions(), meta, self.cache)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(
        0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_full_prefill_matches_hf(checkpoint):
    _, _, hf, ours = checkpoint
    toks = prompt(37, 1)
    got = Paged(ours).step([(toks, 37, [9, 3, 17, 5, 30, 2, 11, 40, 8, 1])], all_logits=True)
    want = hf_logits(hf, toks)
    assert want.std() > 0.5  # the comparison is not between near-constant logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_two_chunk_prefill_reads_first_chunk_from_cache(checkpoint):
    _, _, hf, ours = checkpoint
    toks, blocks = prompt(37, 2), [12, 4, 33, 7, 21, 6, 2, 50, 13, 9]
    paged = Paged(ours)
    first = paged.step([(toks[:18], 18, blocks)], all_logits=True)
    second = paged.step([(toks[18:], 37, blocks)], all_logits=True)
    want = hf_logits(hf, toks)
    torch.testing.assert_close(first, want[:18], atol=ATOL, rtol=0)
    torch.testing.assert_close(second, want[18:], atol=ATOL, rtol=0)


def test_batch_mixing_decode_and_prefill_rows(checkpoint):
    _, _, hf, ours = checkpoint
    a, b, c = prompt(21, 3), prompt(30, 4), prompt(9, 5)
    ba, bb, bc = [7, 1, 30, 22, 15, 3], [2, 40, 11, 5, 19, 8, 27, 33], [44, 6, 13]
    paged = Paged(ours)
    paged.step([(a[:-1], 20, ba), (c[:-1], 8, bc)])
    # a and c decode (different context lengths), b prefills; then b's second chunk with a decode.
    got = paged.step([(a[-1:], 21, ba), (b[:25], 25, bb), (c[-1:], 9, bc)])
    torch.testing.assert_close(got[0], hf_logits(hf, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(hf, b[:25])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2], hf_logits(hf, c)[-1], atol=ATOL, rtol=0)
    got = paged.step([(b[25:], 30, bb), (c[:1], 10, bc)])
    torch.testing.assert_close(got[0], hf_logits(hf, b)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(hf, [*c, c[0]])[-1], atol=ATOL, rtol=0)


def test_decode_rows_of_very_different_lengths(checkpoint):
    """Decode rows are grouped by context length; every grouping must give HF's logits."""
    _, _, hf, ours = checkpoint
    lens = [300, 30, 140, 290]
    seqs = [prompt(n, 10 + i) for i, n in enumerate(lens)]
    tables, free = [], list(range(255, -1, -1))
    for n in lens:
        tables.append([free.pop() for _ in range(-(-(n + 1) // BS))])
    paged = Paged(ours)
    paged.step([(s[:-1], len(s) - 1, t) for s, t in zip(seqs[:3], tables, strict=False)])
    # Three decode rows and a prefill in one step, then decode-only steps.
    got = paged.step(
        [(s[-1:], len(s), t) for s, t in zip(seqs[:3], tables, strict=False)]
        + [(seqs[3], lens[3], tables[3])]
    )
    for row, s in zip(got, seqs, strict=True):
        torch.testing.assert_close(row, hf_logits(hf, s)[-1], atol=ATOL, rtol=0)
    nxt = [*got.argmax(-1).tolist()]
    got = paged.step([([t], len(s) + 1, b) for s, t, b in zip(seqs, nxt, tables, strict=True)])
    if isinstance(ours.attention, TorchSDPABackend):
        assert len(sdpa_plan(paged.meta, BS, torch.float32).decode) > 1
    for row, s, t in zip(got, seqs, nxt, strict=True):
        torch.testing.assert_close(row, hf_logits(hf, [*s, t])[-1], atol=ATOL, rtol=0)


def test_a_lone_long_decode_row_read_in_parts_matches_hf(checkpoint):
    """On two threads the paged kernel reads a lone row of 512 positions in two parts, one a
    thread (tests/test_attention_kernel.py): the logits are still HF's."""
    _, _, hf, ours = checkpoint
    seq, table = prompt(512, 20), list(range(255, 127, -1))
    paged, before = Paged(ours), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        paged.step([(seq[:-1], len(seq) - 1, table)])
        got = paged.step([(seq[-1:], len(seq), table)])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got[0], hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)


def test_greedy_decode_through_cache_matches_hf_generate(checkpoint):
    _, _, hf, ours = checkpoint
    new = 24
    prompts = [prompt(11, 6), prompt(5, 7)]
    tables = [[3, 18, 9, 27, 1, 12, 40, 6, 22, 31], [14, 2, 35, 8, 19, 26, 10, 4]]
    paged = Paged(ours)
    seqs, out = [list(p) for p in prompts], [[] for _ in prompts]
    logits = paged.step([(p, len(p), t) for p, t in zip(prompts, tables, strict=True)])
    for _ in range(new):
        nxt = logits.argmax(-1).tolist()
        for s, o, t in zip(seqs, out, nxt, strict=True):
            s.append(t)
            o.append(t)
        logits = paged.step([([s[-1]], len(s), t) for s, t in zip(seqs, tables, strict=True)])
    for p, o in zip(prompts, out, strict=True):
        gen = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        assert gen[0, len(p) :].tolist() == o


def test_positions_matter(checkpoint):
    """Guard against a vacuous referee: wrong positions must change the logits (a uniform shift
    would not: RoPE attention is relative)."""
    _, _, hf, ours = checkpoint
    toks = prompt(12, 8)
    meta = AttentionMetadata.build([12], [12], [[0, 1, 2]], BS, list(range(12)))
    cache = allocate_kv_cache(ours.config, 4, BS, torch.float32, "cpu")
    shifted = ours(torch.tensor(toks), meta.positions() * 2, meta, cache)
    assert (shifted - hf_logits(hf, toks)).abs().max() > 1e-2


def test_bfloat16_runs_close_to_fp32(checkpoint):
    _, path, hf, _ = checkpoint
    model = load_model(path, dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    toks = prompt(20, 9)
    meta = AttentionMetadata.build([20], [20], [[5, 0, 3, 1, 2]], BS, list(range(20)))
    cache = allocate_kv_cache(model.config, 8, BS, "bfloat16", "cpu")
    got = model(torch.tensor(toks), meta.positions(), meta, cache)
    assert got.dtype == torch.float32
    want = hf_logits(hf, toks)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ours_err = (got - want).abs().mean().item()
    hf_err = (hf_logits(hf_bf16, toks) - want).abs().mean().item()
    assert ours_err < 2 * hf_err + 1e-3  # as accurate as transformers' own bfloat16 path


def test_config_fields(checkpoint):
    name, path, _, _ = checkpoint
    c = load_model_config(path)
    assert c.head_dim == {"llama": 16, "qwen2": 16, "mistral": 24}[name]
    assert c.attention_bias == (name == "qwen2")
    assert c.tie_word_embeddings == (name == "qwen2")
    if name == "llama":
        assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert kv_bytes_per_token(c, "bfloat16") == 2 * 2 * c.num_key_value_heads * c.head_dim * 2


def test_transformers4_config_layout_parses_the_same():
    v5 = {
        "architectures": ["LlamaForCausalLM"],
        **TINY,
        "num_key_value_heads": 2,
        "rope_parameters": LLAMA3_ROPE,
    }
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = 500000.0
    v4["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    v4["rope_scaling"]["type"] = v4["rope_scaling"].pop("rope_type")
    assert parse_config(v4) == parse_config(v5)


def test_copy_blocks_copies_every_layer_k_and_v():
    c = parse_config({"architectures": ["LlamaForCausalLM"], **TINY, "num_key_value_heads": 2})
    cache = allocate_kv_cache(c, 6, BS, torch.float32, "cpu")
    cache.normal_()
    before = cache.clone()
    copy_blocks(cache, [(1, 4), (2, 5)])
    assert torch.equal(cache[:, :, 4], before[:, :, 1])
    assert torch.equal(cache[:, :, 5], before[:, :, 2])
    assert torch.equal(cache[:, :, :4], before[:, :, :4])


def test_unsupported_architecture(checkpoint, tmp_path):
    _, path, _, _ = checkpoint
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(tmp_path / "m")


def test_missing_files_are_named(checkpoint, tmp_path):
    name, path, _, _ = checkpoint
    shutil.copytree(path, tmp_path / "m")
    if name == "mistral":
        shards = sorted((tmp_path / "m").glob("model-0000*-of-0000*.safetensors"))
        assert len(shards) > 1
        victim = shards[-1]
    else:
        victim = tmp_path / "m/model.safetensors"
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(victim.name)):
        load_model(tmp_path / "m")
    (tmp_path / "m/config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path / "m")


def test_model_type_alone_names_the_architecture():
    raw = {**TINY, "model_type": "qwen2", "num_key_value_heads": 2}
    assert parse_config(raw).architecture == "Qwen2ForCausalLM"
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        parse_config({**raw, "model_type": "gpt2"})


def test_kv_heads_must_divide_heads():
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "num_key_value_heads": 3}
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        parse_config(raw)


def test_sliding_window_caps_max_model_len():
    base = {**TINY, "num_key_value_heads": 2, "sliding_window": 128}
    assert parse_config({"architectures": ["MistralForCausalLM"], **base}).max_model_len == 128
    # Qwen2 only uses its window when use_sliding_window is set.
    qwen = parse_config({"architectures": ["Qwen2ForCausalLM"], **base})
    assert qwen.max_model_len == TINY["max_position_embeddings"]
    assert qwen.attention_bias


def test_unexpected_weight_is_rejected(tmp_path):
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(
        {"model.layers.0.self_attn.rotary.weird": torch.zeros(2)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(UnsupportedModelError, match="weird"):
        load_model(tmp_path)
