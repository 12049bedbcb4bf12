"""The character bound the ingress refuses over-long text by, without tokenizing: no text ever
needs fewer tokens than it assumes (so no prompt that fits is refused), and text built from
the longest tokens meets it exactly."""

from __future__ import annotations

import random

import pytest

from prefixserve.cluster.tokenizer import Tokenizer
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.checkpoints import DEFAULT_MODEL, resolve_checkpoint


@pytest.fixture(scope="module", params=["builtin", DEFAULT_MODEL])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "builtin":
        return Tokenizer(ensure_builtin_model())
    return Tokenizer(resolve_checkpoint(request.param))


def test_no_text_packs_more_characters_per_token_than_the_bound(tok: Tokenizer) -> None:
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    texts = sorted((tok.decode([i], skip_special_tokens=False) for i in vocab.values()),
                   key=len, reverse=True)
    rnd = random.Random(0)
    samples = [texts[0] * 50, "".join(texts[:200]), " " * 10_000, "#" * 10_000]
    samples += ["".join(rnd.choices(texts[:2000], k=300)) for _ in range(20)]
    samples += ["".join(rnd.choices(texts, k=300)) for _ in range(20)]
    for text in samples:
        ids = tok.encode(text)
        assert len(text) <= len(ids) * tok.max_chars_per_token, (len(text), len(ids))
    longest = max(samples, key=lambda t: len(t) / len(tok.encode(t)))
    assert len(longest) / len(tok.encode(longest)) > tok.max_chars_per_token / 2  # not loose
