"""Workloads as token ids, so prompt lengths and shared prefixes are exact.

Every run of tokens comes from a generator seeded by (seed, kind, key...), so the same key always
yields the same tokens: that is what makes prefixes shared (the same system prompt, the same
document, the same trace hash id) and everything else unique. A workload is a list of sessions;
a session is one request, or the turns of one chat user sent one after another.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefixserve.bench.load.client import Prompt

TRACE_BLOCK = 512                     # tokens per Mooncake hash id
REPO = Path(__file__).resolve().parents[2]  # the checkout: bench/traces
# Seed-key tags: keep the token runs of different roles independent of each other.
SYSTEM, QUESTION, USER, ANSWER, DOC, TRACE, FILLER, RANDOM, WARMUP = range(1, 10)


@dataclass
class Session:
    turns: list[Prompt]
    think_time_s: float = 0.0         # pause between a reply and the next turn
    arrival_s: float | None = None    # trace arrival offset; None: the load shape decides


@dataclass
class Tokens:
    """Deterministic token runs within [min_id, vocab_size)."""

    vocab_size: int
    seed: int = 0
    min_id: int = 0

    def run(self, n: int, *key: int) -> list[int]:
        if n <= 0:
            return []
        rng = np.random.default_rng([self.seed, *key])
        return rng.integers(self.min_id, self.vocab_size, n).tolist()


@dataclass
class SharedPrefix:
    """SGLang's generated-shared-prefix: groups share a system prompt, questions are unique."""

    num_groups: int = 8
    prompts_per_group: int = 16
    system_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    popularity: str = "uniform"        # or "zipf": group g drawn ∝ 1 / (g+1)^zipf_s
    zipf_s: float = 1.1
    num_requests: int | None = None    # total requests (default groups × prompts per group)

    def sessions(self, tok: Tokens) -> list[Session]:
        rng = np.random.default_rng([tok.seed, SYSTEM])
        total = self.num_requests or self.num_groups * self.prompts_per_group
        if self.popularity == "uniform":
            groups = rng.permutation(np.resize(np.arange(self.num_groups), total))
        elif self.popularity == "zipf":
            weights = 1.0 / np.arange(1, self.num_groups + 1) ** self.zipf_s
            groups = rng.choice(self.num_groups, size=total, p=weights / weights.sum())
        else:
            raise ValueError(f"unknown popularity {self.popularity!r}")
        systems = [tok.run(self.system_len, SYSTEM, g) for g in range(self.num_groups)]
        return [
            Session([Prompt(systems[g] + tok.run(self.question_len, QUESTION, g, i),
                            output_len=self.output_len, group=f"g{g}")])
            for i, g in enumerate(int(g) for g in groups)
        ]


@dataclass
class MultiTurn:
    """Chat users: each turn resends the whole conversation plus a new user message."""

    num_users: int = 8
    turns: int = 4
    system_len: int = 256
    user_len: int = 128
    output_len: int = 128
    think_time_s: float = 0.0

    def sessions(self, tok: Tokens) -> list[Session]:
        # The assistant's earlier replies are stood in for by fixed runs of output_len tokens:
        # the server's real reply is text, and we resend token ids, so lengths stay exact.
        out = []
        for u in range(self.num_users):
            history = tok.run(self.system_len, SYSTEM, u)
            turns = []
            for t in range(self.turns):
                history = history + tok.run(self.user_len, USER, u, t)
                turns.append(Prompt(list(history), output_len=self.output_len, group=f"u{u}"))
                history = history + tok.run(self.output_len, ANSWER, u, t)
            out.append(Session(turns, think_time_s=self.think_time_s))
        return out


@dataclass
class Rag:
    """Long shared documents, several questions each, in shuffled order."""

    num_docs: int = 4
    doc_len: int = 4096
    questions_per_doc: int = 8
    question_len: int = 64
    output_len: int = 128

    def sessions(self, tok: Tokens) -> list[Session]:
        docs = [tok.run(self.doc_len, DOC, d) for d in range(self.num_docs)]
        pairs = [(d, q) for d in range(self.num_docs) for q in range(self.questions_per_doc)]
        order = np.random.default_rng([tok.seed, DOC]).permutation(len(pairs))
        return [
            Session([Prompt(docs[d] + tok.run(self.question_len, QUESTION, d, q),
                            output_len=self.output_len, group=f"d{d}")])
            for d, q in (pairs[i] for i in order)
        ]


@dataclass
class RandomPrompts:
    """Zero-reuse control: every prompt is its own random run."""

    num_requests: int = 64
    input_len: int = 1024
    output_len: int = 128
    tag: int = RANDOM

    def sessions(self, tok: Tokens) -> list[Session]:
        return [Session([Prompt(tok.run(self.input_len, self.tag, i), output_len=self.output_len,
                                group=f"r{i}")])
                for i in range(self.num_requests)]


@dataclass
class Trace:
    """Replay of a Mooncake trace: each hash id becomes its own fixed run of 512 tokens."""

    path: str | Path = "bench/traces/mooncake_conversation_1000.jsonl"
    speedup: float = 1.0              # arrivals at timestamp / speedup
    max_input: int | None = None      # cut prompts (keeps their prefix structure)
    max_output: int | None = None
    limit: int | None = None
    offset: int = 0
    block: int = TRACE_BLOCK
    rows: list[dict] = field(default_factory=list, repr=False)

    def load(self) -> list[dict]:
        if not self.rows:
            self.rows = list(_read_rows(self.resolved_path(), self.offset, self.limit))
        return self.rows

    def resolved_path(self) -> Path:
        """As given; a relative path that is not there is taken relative to the repo root."""
        path = Path(self.path)
        if not path.is_absolute() and not path.exists() and (REPO / path).exists():
            return REPO / path
        return path

    def prompt_tokens(self, row: dict, tok: Tokens) -> list[int]:
        n = row["input_length"]
        if self.max_input is not None:
            n = min(n, self.max_input)
        out: list[int] = []
        for hid in row["hash_ids"]:
            if len(out) >= n:
                break
            out += tok.run(self.block, TRACE, hid)
        if len(out) < n:               # input_length beyond the listed ids: unique filler
            out += tok.run(n - len(out), FILLER, row["_row"])
        return out[:n]

    def sessions(self, tok: Tokens) -> list[Session]:
        rows = self.load()
        t0 = rows[0]["timestamp"] if rows else 0
        out_cap = self.max_output or 1 << 30
        return [
            Session([Prompt(self.prompt_tokens(r, tok),
                            output_len=max(1, min(r["output_length"], out_cap)),
                            group=f"row{r['_row']}")],
                    arrival_s=(r["timestamp"] - t0) / 1000.0 / self.speedup)
            for r in rows
        ]


def _read_rows(path: Path, offset: int, limit: int | None) -> Iterator[dict]:
    with path.open() as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if limit is not None and i >= offset + limit:
                return
            if line.strip():
                yield {**json.loads(line), "_row": i}


def warmup_sessions(workload: list[Session], n: int, tok: Tokens) -> list[Session]:
    """Warm-up requests shaped like the first n, with unique tokens so no prefix gets cached."""
    firsts = [s.turns[0] for s in workload[:n]]
    return [Session([Prompt(tok.run(p.prompt_len, WARMUP, i), output_len=p.output_len,
                            group="warmup")])
            for i, p in enumerate(firsts)]
