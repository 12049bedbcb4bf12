"""Tokenizer, incremental detokenizing and stop strings, on a small byte-level BPE built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from prefixserve.cluster.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    StopChecker,
    Tokenizer,
    TokenizerError,
)

CORPUS = ["hello world, the quick brown fox", "héllo wörld ✓ 日本語 🙂 emoji", "stop here STOP"]


def _write_tokenizer(path: Path, chat_template: str | None = None) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config: dict = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(_write_tokenizer(tmp_path_factory.mktemp("tok")))


def test_roundtrip_and_bytes(tok: Tokenizer) -> None:
    text = "héllo 日本語 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_text(tok.encode("</s>", add_special_tokens=False)[0]) == "</s>"


def test_incremental_detokenize_never_splits_a_character(tok: Tokenizer) -> None:
    text = "a 🙂 日本語 ✓ b"
    ids = tok.encode(text)
    # 🙂 is 4 bytes; with this vocabulary some tokens are lone bytes of it
    assert any(tok.token_text(i) == "\ufffd" for i in ids)
    detok = tok.detokenizer()
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenize_skips_prompt_and_special_tokens(tok: Tokenizer) -> None:
    prompt = tok.encode("hello world")
    eos = tok.encode("</s>", add_special_tokens=False)
    detok = tok.detokenizer(prompt)
    out = detok.add(tok.encode(", the fox")) + detok.add(eos) + detok.flush()
    assert out == ", the fox"


def test_detokenizer_writes_special_tokens_when_asked(tok: Tokenizer) -> None:
    eos = tok.encode("</s>", add_special_tokens=False)
    detok = tok.detokenizer(tok.encode("hi"), skip_special=False)
    assert detok.add(tok.encode(", the fox")) + detok.add(eos) + detok.flush() == ", the fox</s>"


def test_flush_shows_an_unfinished_character_as_replacement(tok: Tokenizer) -> None:
    emoji_bytes = [i for i in tok.encode("🙂") if tok.token_text(i) == "\ufffd"]
    detok = tok.detokenizer()
    assert detok.add(emoji_bytes[:1]) == ""
    assert detok.flush() == "\ufffd"


def test_stop_string_split_across_tokens(tok: Tokenizer) -> None:
    stop = StopChecker(["STOP"])
    detok = tok.detokenizer()
    out, stopped = "", False
    for piece in ["stop here S", "TO", "P and more"]:
        for i in tok.encode(piece):
            text, stopped = stop.add(detok.add([i]))
            out += text
            if stopped:
                break
        if stopped:
            break
    assert stopped
    assert out == "stop here "


def test_stop_checker_holds_back_possible_prefix_then_releases() -> None:
    stop = StopChecker(["</end>", "zz"])
    assert stop.add("abc</e") == ("abc", False)  # "</e" could become "</end>"
    assert stop.add("x") == ("</ex", False)  # it did not
    assert stop.add("z") == ("", False)
    assert stop.add("z tail") == ("", True)  # "zz" matched: output ends before it
    assert stop.text == "abc</ex"
    assert stop.add("more") == ("", True)


def test_stop_checker_earliest_match_and_flush() -> None:
    stop = StopChecker(["cd", "bcde"])
    assert stop.add("abcdef") == ("a", True)  # "bcde" starts first
    held = StopChecker(["xyz"])
    assert held.add("hello xy") == ("hello ", False)
    assert held.flush() == "xy"
    assert StopChecker().add("free text") == ("free text", False)


def test_stop_checker_names_the_match_and_can_keep_it() -> None:
    stop = StopChecker(["cd", "bcde"], include=True)
    assert stop.add("ab") == ("a", False)  # "b" could start "bcde"
    assert stop.add("cdef") == ("bcde", True)  # the earliest match, kept in the output
    assert (stop.matched, stop.text) == ("bcde", "abcde")
    plain = StopChecker(["cd", "bcde"])
    assert plain.add("xxcdyy") == ("xx", True)
    assert plain.matched == "cd"
    assert StopChecker(["q"]).matched is None


def test_stop_strings_before_min_tokens_do_not_count() -> None:
    stop = StopChecker(["END"])
    assert stop.add("a END b", check=False) == ("a END b", False)  # inside min_tokens
    assert stop.add(" c EN", check=False) == (" c ", False)  # a possible start is held
    assert stop.add("D d") == ("", True)  # past min_tokens a match ending here counts
    assert stop.text == "a END b c "


def test_chat_template_from_config(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer(_write_tokenizer(tmp_path, template))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.render_chat(msgs)
    assert text == "<s>[system]be brief</s>[user]hi</s>[assistant]"
    assert tok.render_chat(msgs, add_generation_prompt=False).endswith("hi</s>")
    ids = tok.encode_chat(msgs)
    assert ids[0] == tok.encode("<s>", add_special_tokens=False)[0]
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_file_wins_and_default_is_chatml(tmp_path: Path) -> None:
    path = _write_tokenizer(tmp_path / "a")
    assert Tokenizer(path).chat_template == DEFAULT_CHAT_TEMPLATE
    rendered = Tokenizer(path).render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer(path).render_chat([{"role": "user", "content": "hi"}]) == "hi!"


def test_chat_template_errors_are_clear(tmp_path: Path) -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    tok = Tokenizer(_write_tokenizer(tmp_path / "s", strict))
    with pytest.raises(TokenizerError, match="user first"):
        tok.render_chat([{"role": "assistant", "content": "x"}])
    sandboxed = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(TokenizerError):
        Tokenizer(_write_tokenizer(tmp_path / "b", sandboxed)).render_chat([])
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer(tmp_path / "missing")
