"""Text ↔ tokens at the ingress: the checkpoint's `tokenizer.json`, its chat template, and the
incremental detokenizing and stop-string logic that streaming needs.

Workers are token-in / token-out; everything textual lives here. Three subtleties:

* A chat template marks turns with control tokens (`<|im_start|>`, `<|eot_id|>`). Tokenizing
  the rendered text as one string would turn a control string written *inside a message* into
  that token too, so a user could forge a system or assistant turn (transformers and vLLM do
  so). `encode_chat` keeps such strings text: the rendered text is tokenized as usual except at
  the control strings that came from message text, where the plain text's tokens go instead.
  The tokenizer splits text at control strings anyway, so every other token is what tokenizing
  the whole text gives, and a conversation whose messages hold no control string is tokenized
  exactly as transformers' `apply_chat_template(tokenize=True)` does.

* A byte-level tokenizer may emit a multi-byte UTF-8 character across several tokens. Decoding
  the tokens so far then ends in U+FFFD; `IncrementalDetokenizer` holds such text back until the
  character completes (the vLLM prefix/read-offset scheme), so a stream never carries a broken
  character.
* A stop string may arrive split across tokens. `StopChecker` holds back any tail of the text
  that could still grow into a stop string, and truncates the output where one matches.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from prefixserve.cluster.chat_template import TemplateRaised, TokenizerError, compile_chat_template
from prefixserve.workers.byte_level import bytes_to_unicode

# ChatML, used when the checkpoint ships no chat template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens of the prompt's tail decoded along with the output: tokenizers that drop a leading
# space at the start of a sequence (SentencePiece) then decode the first output token correctly.
_PROMPT_CONTEXT_TOKENS = 6
# The named special tokens transformers passes to a chat template (`special_tokens_map`).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
# Variables the renderer sets itself; `chat_template_kwargs` may not replace them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt"})
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


class TemplateKwargsError(TokenizerError):
    """`chat_template_kwargs` tried to set a variable the renderer owns."""


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _decoder_types(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    types = {spec.get("type", "")}
    for sub in spec.get("decoders") or []:
        types |= _decoder_types(sub)
    return types


def _load(path: Path) -> tuple[HFTokenizer, dict[str, Any], Path | None]:
    """The backend tokenizer and `tokenizer_config.json` of a checkpoint directory, a GGUF or a
    bare `tokenizer.json`, and the directory a `chat_template.jinja` may sit in (None for a
    GGUF: its template is in its metadata)."""
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        from prefixserve.workers.gguf import GGUFFile  # numpy/torch: only when serving a GGUF
        from prefixserve.workers.gguf_tokenizer import build_tokenizer, tokenizer_config

        gguf = GGUFFile(path)
        return build_tokenizer(gguf), tokenizer_config(gguf), None
    tok_file, folder = (path, path.parent) if path.is_file() else (path / "tokenizer.json", path)
    if not tok_file.is_file():
        raise TokenizerError(f"{tok_file} not found: prefixserve needs a fast tokenizer file")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return HFTokenizer.from_file(str(tok_file)), config, folder


class Tokenizer:
    """A checkpoint's tokenizer: `tokenizer.json` (+ `tokenizer_config.json`, chat template),
    or the one in a `.gguf` file's metadata.

    `path` may also be a tokenizer directory or a `tokenizer.json` file (vLLM's `--tokenizer`);
    `chat_template` (text) replaces the one the tokenizer brings (vLLM's `--chat-template`).
    """

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        self._tok, config, folder = _load(Path(path))
        self.special_tokens = {
            name: content
            for name in _SPECIAL_TOKENS
            if (content := _token_content(config.get(name))) is not None
        }
        self.chat_template = chat_template or self._find_chat_template(folder, config)
        self._template = compile_chat_template(self.chat_template)
        spec = json.loads(self._tok.to_str())
        decoders = _decoder_types(spec.get("decoder"))
        self._byte_level = "ByteLevel" in decoders
        self._byte_fallback = "ByteFallback" in decoders
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        # The control strings (special tokens' text), longest first so that a match takes the
        # longest; and a twin of the tokenizer that reads them as plain text.
        self.control_strings = tuple(sorted({t.content for t in added.values() if t.special},
                                            key=len, reverse=True))
        self._as_text = HFTokenizer.from_str(self._tok.to_str())
        self._as_text.encode_special_tokens = True
        # Characters of text one token can stand for, at most: the longest vocabulary entry
        # (a byte-level piece has a character per byte, SentencePiece's "▁" is the space),
        # four times over when a normalizer may compose up to four code points into one
        # (NFC/NFKC). Text longer than max_model_len times this cannot fit the context, so the
        # ingress refuses it without tokenizing. SmolLM2's: 81 (a run of spaces).
        longest = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars_per_token = longest * (4 if spec.get("normalizer") else 1)

    @staticmethod
    def _find_chat_template(folder: Path | None, config: dict[str, Any]) -> str:
        # chat_template.jinja: where transformers >= 4.43 saves it
        if folder is not None and (jinja_file := folder / "chat_template.jinja").is_file():
            return jinja_file.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template if isinstance(template, str) else DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it throughout), so a long
        # text encoded on a worker thread leaves the event loop running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str:
        """Text of `ids`; skipping special tokens, those in `keep` are still written."""
        if skip_special_tokens and not keep.isdisjoint(ids):
            ids = [i for i in ids if i in keep or i not in self._special_ids]
            return self._tok.decode(ids, skip_special_tokens=False)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_ids(self, texts: Iterable[str]) -> frozenset[int]:
        """The control tokens whose text is one of `texts` (e.g. a tool-call marker, which the
        output must keep for the tool-call parser)."""
        wanted = set(texts)
        return frozenset(i for i in self._special_ids if self._added[i] in wanted)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to `[{"role", "content"}, ...]`, as text: what
        transformers' `apply_chat_template(messages, tools=tools, tokenize=False, ...)` gives.
        The template sees the named special tokens, `tools` and `documents` (None), then
        `template_kwargs` (a request's `chat_template_kwargs`, e.g. `enable_thinking`; they may
        override the special tokens, as in transformers) and the messages, with None-valued
        keys dropped."""
        extra = template_kwargs or {}
        if reserved := sorted(RESERVED_TEMPLATE_VARS & extra.keys()):
            raise TemplateKwargsError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        variables = {**self.special_tokens, "tools": tools or None, "documents": None, **extra}
        try:
            return self._template.render(
                variables,
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateRaised as exc:
            raise TokenizerError(f"chat template rejected the conversation: {exc}") from None
        except Exception as exc:  # a broken template must be a clear error, not a 500
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    def render_chat_pieces(self, messages: list[dict[str, Any]],
                           add_generation_prompt: bool = True,
                           template_kwargs: dict[str, Any] | None = None,
                           controls_as_text: bool = True,
                           tools: list[dict[str, Any]] | None = None) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, literal) pieces; a literal piece is a control
        string from the client's text (any string in the messages or the tools), to be
        tokenized as plain text. One piece when no such text holds a control string, or with
        ``controls_as_text=False``."""
        controls = self.control_strings
        if not controls_as_text or not any(c in v for v in _strings([messages, tools])
                                           for c in controls):
            return [(self.render_chat(messages, add_generation_prompt, template_kwargs, tools),
                     False)]
        # Each control string in client text becomes a marker no text holds, rendered, then
        # split on: the template may move the text about, the markers go with it.
        mark = f"\U000f0000{secrets.token_hex(8)}"
        found = re.compile("|".join(map(re.escape, controls)))
        index = {c: i for i, c in enumerate(controls)}

        def marked(value: Any) -> Any:
            if isinstance(value, str):
                return found.sub(lambda m: f"{mark}{index[m.group()]}\U000f0001", value)
            if isinstance(value, dict):
                return {marked(k): marked(v) for k, v in value.items()}
            if isinstance(value, list):
                return [marked(v) for v in value]
            return value

        rendered = self.render_chat(
            [{k: v if k == "role" else marked(v) for k, v in m.items()} for m in messages],
            add_generation_prompt, template_kwargs, marked(tools))
        parts = re.split(f"{re.escape(mark)}(\\d+)\U000f0001", rendered)
        pieces = [(parts[0], False)]
        for i in range(1, len(parts), 2):
            pieces += [(controls[int(parts[i])], True), (parts[i + 1], False)]
        return [p for p in pieces if p[0]]

    def encode_pieces(self, pieces: list[tuple[str, bool]], add_special_tokens: bool = False
                      ) -> list[int]:
        """Token ids of text pieces (as `render_chat_pieces` gives), literal ones as plain
        text; with ``add_special_tokens`` the post-processor's (BOS) around the whole."""
        if len(pieces) == 1 and not pieces[0][1]:
            return self.encode(pieces[0][0], add_special_tokens)
        encodings = [(self._as_text if literal else self._tok).encode(
            text, add_special_tokens=False) for text, literal in pieces]
        merged = Encoding.merge(encodings)
        if add_special_tokens:
            merged = self._tok.post_process(merged)
        return merged.ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    controls_as_text: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation's token ids: control strings in message text stay text (unless
        ``controls_as_text=False``, transformers' and vLLM's behaviour). The template writes
        BOS itself when the model wants it (as transformers does)."""
        return self.encode_pieces(self.render_chat_pieces(
            messages, add_generation_prompt, template_kwargs, controls_as_text, tools))

    def token_piece(self, token_id: int) -> str:
        """A token's vocabulary entry as stored (e.g. "Ġhello"), as vLLM's /tokenize shows it."""
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a multi-byte character)."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            return b"".join(
                bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode() for c in piece
            )
        if self._byte_fallback and (m := _BYTE_FALLBACK.match(piece)):
            return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs (broken bytes shown as U+FFFD, as OpenAI does)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def detokenizer(self, prompt_ids: Sequence[int] = (), keep: frozenset[int] = frozenset(),
                    skip_special: bool = True) -> IncrementalDetokenizer:
        """A detokenizer for output that follows `prompt_ids` (whose text is not emitted),
        writing the special tokens in `keep` and skipping the others (all written without
        `skip_special`)."""
        tail = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        return IncrementalDetokenizer(self, tail, prefix_offset=0, read_offset=len(tail),
                                      keep=keep, skip_special=skip_special)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a UTF-8 character.

    Decodes ``tokens[prefix_offset:]`` and emits what it adds over ``tokens[prefix_offset:
    read_offset]``; while the decoded text ends in U+FFFD (an incomplete byte sequence) nothing
    is emitted and the offsets stay put, so the character comes out whole once complete.
    """

    tokenizer: Tokenizer
    tokens: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0  # tokens before it are context only (the prompt's tail)
    keep: frozenset[int] = frozenset()  # special tokens written as text (tool-call markers)
    skip_special: bool = True  # False: every special token is written (vLLM's option)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special, keep=self.keep)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self.tokens.extend(token_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever is held back, broken bytes shown as U+FFFD."""
        if self.read_offset >= len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return new_text[len(prefix_text) :]


class StopChecker:
    """Finds stop strings in streamed text; holds back a tail that could start one.

    `add` returns the text that is safe to emit and whether a stop string matched (the output
    then ends just before it: the stop string itself is not part of the output, unless
    ``include``, vLLM's include_stop_str_in_output). With ``check=False`` (before a request's
    ``min_tokens``, as vLLM) the text is taken in without searching: a stop string that ends
    there does not count.
    """

    def __init__(self, stops: Sequence[str] = (), include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self._max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all text seen so far (truncated at the match once stopped)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, new_text: str, check: bool = True) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            self.text += new_text
            self.emitted = len(self.text)
            return new_text, False
        # A match must end inside the new text; older text was already searched.
        start = max(0, len(self.text) - self._max_len + 1)
        self.text += new_text
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0] \
            if check else []
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            end = at + len(self.matched) if self.include else at
            out = self.text[self.emitted : end]
            self.text = self.text[:end]
            self.emitted = end
            self.stopped = True
            return out, True
        hold = self._partial_match_len()
        safe = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out, False

    def _partial_match_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for k in range(min(self._max_len - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """At the end of the output: the held-back tail (it never became a stop string)."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
