"""GPT-2's byte-level alphabet: the printable character that stands for each byte in the
vocabulary of a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2, SmolLM, ...).

One copy for the built-in tokenizer, the ingress's byte decoding and the test GGUF writer.
`tokenizers`' `ByteLevel.alphabet()` holds the same characters but as an unordered set, so the
byte -> character pairing is rebuilt here the way GPT-2 defines it. Torch-free (the ingress
imports it).
"""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """Byte 0..255 -> its character: printable Latin-1 bytes stand for themselves, the others
    take 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
