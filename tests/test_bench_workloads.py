"""Workload structure: what is shared, what is not, seeds, and Mooncake trace expansion."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from prefixserve.bench.load.workloads import (
    MultiTurn,
    Rag,
    RandomPrompts,
    SharedPrefix,
    Tokens,
    Trace,
    warmup_sessions,
)

TOK = Tokens(vocab_size=50_000, seed=7)
REAL_TRACE = Path(__file__).resolve().parent / "data/mooncake_synthetic_trace_head.jsonl"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    w = SharedPrefix(num_groups=3, prompts_per_group=4, system_len=64, question_len=16,
                     output_len=8)
    sessions = w.sessions(TOK)
    prompts = [s.turns[0] for s in sessions]
    assert len(prompts) == 12
    assert Counter(p.group for p in prompts) == {"g0": 4, "g1": 4, "g2": 4}
    assert all(len(p.tokens) == 80 and p.output_len == 8 for p in prompts)
    by_group: dict[str, list] = {}
    for p in prompts:
        by_group.setdefault(p.group, []).append(p.tokens)
    for toks in by_group.values():
        assert all(_common_prefix(toks[0], t) == 64 for t in toks[1:])
    assert _common_prefix(by_group["g0"][0], by_group["g1"][0]) == 0
    assert [p.tokens for p in prompts] == [s.turns[0].tokens for s in w.sessions(TOK)]
    more = SharedPrefix(3, 4, 64, 16, 8, num_requests=18).sessions(TOK)
    assert Counter(s.turns[0].group for s in more) == {"g0": 6, "g1": 6, "g2": 6}
    other = SharedPrefix(3, 4, 64, 16, 8).sessions(Tokens(50_000, seed=8))
    assert other[0].turns[0].tokens != prompts[0].tokens


def test_zipf_popularity_skews_towards_first_groups() -> None:
    w = SharedPrefix(num_groups=10, system_len=4, question_len=4, popularity="zipf",
                     zipf_s=1.2, num_requests=2000)
    counts = Counter(s.turns[0].group for s in w.sessions(TOK))
    assert sum(counts.values()) == 2000
    assert counts["g0"] > 2 * counts["g3"] > 0
    assert counts["g0"] > counts["g1"] > counts["g9"]


def test_multi_turn_each_turn_extends_the_previous_conversation() -> None:
    w = MultiTurn(num_users=2, turns=3, system_len=32, user_len=8, output_len=4, think_time_s=0.5)
    s0, s1 = w.sessions(TOK)
    lens = [len(p.tokens) for p in s0.turns]
    assert lens == [40, 52, 64]                      # + answer 4 + user 8 per turn
    for a, b in zip(s0.turns, s0.turns[1:], strict=False):
        assert b.tokens[:len(a.tokens)] == a.tokens
    assert s0.think_time_s == 0.5
    assert _common_prefix(s0.turns[0].tokens, s1.turns[0].tokens) == 0


def test_rag_questions_share_their_document() -> None:
    prompts = [s.turns[0] for s in Rag(2, 100, 3, 10, 5).sessions(TOK)]
    assert len(prompts) == 6 and all(len(p.tokens) == 110 for p in prompts)
    d0 = [p.tokens for p in prompts if p.group == "d0"]
    assert all(_common_prefix(d0[0], t) == 100 for t in d0[1:])


def test_random_prompts_share_nothing_and_respect_vocab() -> None:
    tok = Tokens(vocab_size=300, seed=1, min_id=10)
    prompts = [s.turns[0].tokens for s in RandomPrompts(20, 64, 4).sessions(tok)]
    assert all(len(p) == 64 for p in prompts)
    assert all(10 <= t < 300 for p in prompts for t in p)
    assert len({tuple(p[:8]) for p in prompts}) == 20
    warm = warmup_sessions(RandomPrompts(20, 64, 4).sessions(tok), 3, tok)
    assert [len(s.turns[0].tokens) for s in warm] == [64] * 3
    assert all(s.turns[0].tokens not in prompts for s in warm)


def _write_trace(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_rows_sharing_k_ids_share_exactly_k_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 1800, "output_length": 9, "hash_ids": [5, 6, 7, 8]},
        {"timestamp": 1500, "input_length": 1400, "output_length": 3, "hash_ids": [5, 6, 9]},
        {"timestamp": 3000, "input_length": 600, "output_length": 2, "hash_ids": [11, 12]},
    ]
    trace = Trace(_write_trace(tmp_path, rows), speedup=2.0)
    sessions = trace.sessions(TOK)
    a, b, c = (s.turns[0] for s in sessions)
    assert [len(p.tokens) for p in (a, b, c)] == [1800, 1400, 600]
    assert _common_prefix(a.tokens, b.tokens) == 2 * 512          # share ids 5, 6 exactly
    assert a.tokens[1024] != b.tokens[1024]
    assert _common_prefix(a.tokens, c.tokens) == 0
    assert [s.arrival_s for s in sessions] == pytest.approx([0.0, 0.25, 1.0])
    assert [p.output_len for p in (a, b, c)] == [9, 3, 2]
    # the same ids give the same tokens under the same seed, wherever they appear
    again = Trace(trace.path, limit=1, offset=1).sessions(TOK)[0].turns[0]
    assert again.tokens == b.tokens


def test_trace_max_input_and_slice(tmp_path: Path) -> None:
    rows = [{"timestamp": i, "input_length": 2000, "output_length": 50, "hash_ids": [1, 2, 3, 4]}
            for i in range(10)]
    trace = Trace(_write_trace(tmp_path, rows), max_input=700, max_output=20, limit=4, offset=3)
    prompts = [s.turns[0] for s in trace.sessions(TOK)]
    assert len(prompts) == 4
    assert all(len(p.tokens) == 700 and p.output_len == 20 for p in prompts)
    assert all(p.tokens == prompts[0].tokens for p in prompts)
    assert [p.group for p in prompts] == ["row3", "row4", "row5", "row6"]


def test_real_mooncake_trace_expands_within_the_cap() -> None:
    trace = Trace(REAL_TRACE, max_input=2048, limit=50)
    sessions = trace.sessions(Tokens(vocab_size=256))
    assert len(sessions) == 50
    assert all(0 < len(s.turns[0].tokens) <= 2048 for s in sessions)
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
