"""A Hugging Face `tokenizers.Tokenizer` rebuilt from a GGUF file's metadata.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary (ids are positions), the
token types, the merges or scores and the special token ids as metadata. This module turns them
back into the fast tokenizer (and `tokenizer_config.json`) the ingress already speaks, so a GGUF
checkpoint serves without its original Hugging Face repository.

Two vocabulary kinds are served (`tokenizer.ggml.model`):

* ``gpt2`` — byte-level BPE (Llama-3, Qwen2, SmolLM, ...). How text is split before BPE is not
  in the merges; llama.cpp names it in `tokenizer.ggml.pre` and so do we.
* ``llama`` — SentencePiece-style BPE with byte fallback (Llama-2, Mistral). Older files carry
  no merges; they are recovered from the vocabulary and scores, ordered as transformers does, so
  both tokenize alike.

Token types (llama.cpp's `LLAMA_TOKEN_TYPE_*`) decide which tokens are matched whole in text:
UNKNOWN and CONTROL ones as special tokens, USER_DEFINED ones as plain added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from prefixserve.workers.gguf import GGUFError, GGUFFile

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp token types (1 normal, 6 byte)
SPACE = "▁"  # SentencePiece's visible space

# How each pre-tokenizer named in `tokenizer.ggml.pre` splits text (llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # as Llama-3's, but every digit on its own
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT}

_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The fast tokenizer the file describes; GGUFError for a kind we cannot build."""
    kind = gguf.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise GGUFError(
            f"{gguf.path}: cannot build a tokenizer of type {kind!r} "
            f"(tokenizer.ggml.model); supported: {', '.join(builders)}"
        )
    tokens = _tokens(gguf)
    tok = builders[kind](gguf, tokens)
    _add_tokens_matched_whole(gguf, tok, tokens)
    if (post := _post_processor(gguf, tokens)) is not None:
        tok.post_processor = post
    return tok


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """What `tokenizer_config.json` would hold: special tokens, chat template, BOS/EOS flags."""
    tokens = _tokens(gguf)
    config: dict[str, Any] = {name: tokens[i] for name, i in _special_ids(gguf, tokens).items()}
    template = gguf.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    add_bos, add_eos = _add_bos_eos(gguf)
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    context = gguf.get(f"{gguf.arch}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    config.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
    return config


def write_tokenizer_files(gguf: GGUFFile, directory: Path) -> None:
    """Save `tokenizer.json` and `tokenizer_config.json`, as a Hugging Face checkpoint has."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(gguf).save(str(directory / "tokenizer.json"))
    config = json.dumps(tokenizer_config(gguf), indent=2, ensure_ascii=False)
    (directory / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


def _tokens(gguf: GGUFFile) -> list[str]:
    tokens = gguf.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{gguf.path}: no vocabulary (tokenizer.ggml.tokens)")
    return list(tokens)


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token → id, ids being positions; a duplicated spelling keeps its last id, as HF does."""
    return {token: index for index, token in enumerate(tokens)}


def _file_merges(gguf: GGUFFile) -> list[tuple[str, str]] | None:
    merges = gguf.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = (merge.split(" ", 1) for merge in merges)
    return [(left, right) for left, right in pairs]


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    """GPT-2-style BPE over bytes spelled as printable characters; the split comes from `pre`."""
    merges = _file_merges(gguf)
    if merges is None:
        raise GGUFError(f"{gguf.path}: a gpt2 tokenizer without tokenizer.ggml.merges")
    tok = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(gguf.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """How text is cut before BPE: what the model's original `tokenizer.json` does."""
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    """Llama-2-style BPE over "▁"-spaced text; unknown bytes fall back to <0xNN> tokens."""
    vocab = _vocab(tokens)
    merges = _file_merges(gguf)
    if merges is None:
        scores = gguf.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFError(f"{gguf.path}: a llama tokenizer needs merges or one score per token")
        merges = merges_from_scores(tokens, scores)
    unk_id = _special_ids(gguf, tokens).get("unk_token")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    prefix_space = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    # "first": the space goes before the text's start only, not after each special token.
    scheme = "first" if prefix_space else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme,
                                                 split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:  # drop the space the encoder put in front
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, in the order transformers uses.

    Every way to cut a token into two pieces that are both in the vocabulary is a merge; merges
    rank by the score of the token they make (best first), then by longer left piece, then by
    longer right piece; remaining ties keep vocabulary order, and within one token the order of
    the pieces' ids. (transformers' `generate_merges`, which tokenizes these files.)
    """
    vocab = _vocab(tokens)
    best = dict(zip(tokens, scores, strict=True))  # a repeated token keeps its last score
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in best.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = [(left, right) for left, right in pairs if left in vocab and right in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked += [(score, len(left), len(right), left, right) for left, right in pairs]
    ranked.sort(key=lambda m: m[:3], reverse=True)  # stable: ties keep the order built above
    return [(left, right) for *_, left, right in ranked]


def _add_tokens_matched_whole(gguf: GGUFFile, tok: Tokenizer, tokens: list[str]) -> None:
    """Control and unknown tokens become special tokens, user-defined ones added tokens.

    llama.cpp matches both whole in the text; without this BPE would cut `<|im_start|>` into
    pieces. Their spelling is already in the vocabulary, so they keep their ids.
    """
    types = gguf.get("tokenizer.ggml.token_type") or []
    special = [t for t, kind in zip(tokens, types, strict=False) if kind in (UNKNOWN, CONTROL)]
    special += [tokens[i] for i in _special_ids(gguf, tokens).values()]  # named, whatever type
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(special)]
    )
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _special_ids(gguf: GGUFFile, tokens: list[str]) -> dict[str, int]:
    """`{"bos_token": 1, ...}` for the special token ids the metadata names (and that exist)."""
    ids = {name: gguf.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL_IDS.items()}
    return {name: int(i) for name, i in ids.items() if i is not None and 0 <= int(i) < len(tokens)}


def _add_bos_eos(gguf: GGUFFile) -> tuple[bool, bool]:
    """llama.cpp adds BOS to a SentencePiece vocabulary unless told not to; to BPE only if told."""
    add_bos = gguf.get("tokenizer.ggml.add_bos_token")
    add_eos = gguf.get("tokenizer.ggml.add_eos_token")
    if add_bos is None:
        add_bos = gguf.get("tokenizer.ggml.model") == "llama"
    return bool(add_bos), bool(add_eos)


def _post_processor(gguf: GGUFFile, tokens: list[str]) -> processors.PostProcessor | None:
    """BOS in front and/or EOS behind each sequence, when the model wants them; else None."""
    add_bos, add_eos = _add_bos_eos(gguf)
    ids = _special_ids(gguf, tokens)
    bos = ids.get("bos_token") if add_bos else None
    eos = ids.get("eos_token") if add_eos else None
    if bos is None and eos is None:
        return None

    def sequence(name: str, type_id: int) -> str:
        parts = [f"${name}:{type_id}"]
        if bos is not None:
            parts.insert(0, f"{tokens[bos]}:{type_id}")
        if eos is not None:
            parts.append(f"{tokens[eos]}:{type_id}")
        return " ".join(parts)

    used = dict.fromkeys(i for i in (bos, eos) if i is not None)
    return processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=f"{sequence('A', 0)} {sequence('B', 1)}",
        special_tokens=[(tokens[i], i) for i in used],
    )
