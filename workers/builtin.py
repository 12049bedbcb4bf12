"""A built-in tiny model so the whole stack runs with no download: `prefixserve-tiny`.

Random weights (fixed seed) in a Llama-3-shaped GQA checkpoint, written in the real Hugging Face
layout (config.json, model.safetensors, generation_config.json) with a byte-level `tokenizers`
tokenizer, so it goes through exactly the loader and tokenizer paths a real model does. It is
written once, atomically (a temp dir renamed into place), so racing processes are safe; the
folder name carries a version so a format change rebuilds it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from prefixserve.workers.byte_level import bytes_to_unicode
from prefixserve.workers.cache import cached_directory, default_cache_dir

BUILTIN_VERSION = 1
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
)
BOS_ID, END_OF_TEXT_ID, EOT_ID = 256, 257, 260
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": [END_OF_TEXT_ID, EOT_ID],
    "torch_dtype": "float32",
}


def ensure_builtin_model(cache_dir: Path | None = None) -> Path:
    """Path of the built-in checkpoint, writing it first if absent."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_directory(root / f"builtin-v{BUILTIN_VERSION}", write_builtin_model)


def write_builtin_model(path: Path) -> None:
    """Write every file of the checkpoint into the existing directory `path`."""
    save_file(_weights(), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [END_OF_TEXT_ID, EOT_ID]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _tokenizer().save(str(path / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def _weights() -> dict[str, torch.Tensor]:
    """Llama weights with unit-scale activations (std 1/sqrt(fan_in)), so logits are not flat."""
    c = CONFIG
    gen = torch.Generator().manual_seed(0)
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features**0.5

    w = {"model.embed_tokens.weight": torch.randn(VOCAB_SIZE, hidden, generator=gen)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(q, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, q)
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    w["lm_head.weight"] = linear(VOCAB_SIZE, hidden)
    return w


def _tokenizer() -> Tokenizer:
    """Byte-level: token id == byte value, no merges; specials from 256; BOS prepended."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    return tok
