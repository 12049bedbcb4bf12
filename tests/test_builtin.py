"""The built-in model: written once and atomically, readable by our loader, transformers and
tokenizers, and numerically the same model under both."""

import threading

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.builtin import BOS_ID, EOT_ID, VOCAB_SIZE, ensure_builtin_model
from prefixserve.workers.kv_tensor import allocate_kv_cache
from prefixserve.workers.models.config import load_model_config
from prefixserve.workers.models.loader import load_model


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    return ensure_builtin_model(tmp_path_factory.mktemp("cache"))


def test_layout_and_config(builtin):
    names = {p.name for p in builtin.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    c = load_model_config(builtin)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (8, 2, VOCAB_SIZE)
    assert EOT_ID in c.eos_token_ids


def test_written_once(builtin):
    stamp = (builtin / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model(builtin.parent) == builtin
    assert (builtin / "model.safetensors").stat().st_mtime_ns == stamp


def test_racing_writers_agree_and_leave_no_temp_dirs(tmp_path):
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_builtin_model(tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    load_model(results[0])


def test_env_var_picks_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE", str(tmp_path))
    assert ensure_builtin_model().parent == tmp_path


def test_transformers_loads_the_same_model(builtin):
    ours = load_model(builtin)
    hf = transformers.LlamaForCausalLM.from_pretrained(builtin, dtype=torch.float32).eval()
    toks = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.build([40], [40], [[3, 0, 2]], 16, list(range(40)))
    cache = allocate_kv_cache(ours.config, 4, 16, torch.float32, "cpu")
    got = ours(toks, meta.positions(), meta, cache)
    with torch.no_grad():
        want = hf(toks[None]).logits[0]
    assert want.std() > 0.5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_tokenizer_is_byte_level_and_readable_by_both(builtin):
    text = "héllo wörld 日本 <|eot_id|>"
    tok = Tokenizer.from_file(str(builtin / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids[0] == BOS_ID and ids[-1] == EOT_ID
    assert ids[1:-2] == list("héllo wörld 日本".encode())
    assert tok.decode(ids) == "héllo wörld 日本 "
    auto = transformers.AutoTokenizer.from_pretrained(builtin)
    assert auto(text).input_ids == ids
    assert (auto.bos_token_id, auto.eos_token_id) == (BOS_ID, EOT_ID)
    chat = auto.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
