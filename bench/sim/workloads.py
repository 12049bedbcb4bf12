"""Generated workloads for the tier-2 simulator: open arrivals of chat users and of requests to
shared-prompt groups, at a rate that sets the fleet's load.

A workload is a list of :class:`SimSession`: one arrival time and the turns that follow it. A
chat user's next turn arrives a think time after the reply to the last one (the simulator
schedules it when that reply finishes), and resends the whole conversation: the system prompt,
every earlier message and reply, and a new message. A turn here holds only what it adds; the
simulator puts the prompts together with the replies its engines generate (their token source
is a function of the request, so the reply is known before the run), as a client resending
the reply's text does. Token runs come from
:class:`~prefixserve.bench.load.workloads.Tokens`, so the same key gives the same tokens and
everything else is unique.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from prefixserve.bench.load.workloads import QUESTION, SYSTEM, USER, Tokens

ARRIVALS = 11  # seed-key tag of the arrival times and lengths (apart from the token runs')


@dataclass
class Turn:
    tokens: list[int]  # what the turn adds to the conversation (all of a single request)
    output_len: int


@dataclass
class SimSession:
    """A first arrival, the turns in order, and the pause before each turn after the first
    (whose prompt is the conversation so far: earlier turns, their replies, its own tokens)."""

    arrival_s: float
    turns: list[Turn]
    think_s: list[float]


def _poisson(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """``n`` arrival times of a Poisson process at ``rate`` a second, from 0."""
    gaps = rng.exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]


def _lengths(rng: np.random.Generator, span: tuple[int, int], n: int) -> list[int]:
    low, high = span
    return rng.integers(low, high + 1, n).tolist()


@dataclass
class ChatUsers:
    """Multi-turn chat: users arrive at ``rate`` a second, all with one system prompt, each
    sending ``turns`` messages about ``think_s`` apart (uniform in 0.5-1.5x)."""

    users: int = 1600
    turns: int = 8
    system_len: int = 512
    message_len: tuple[int, int] = (64, 256)
    answer_len: tuple[int, int] = (128, 384)
    think_s: float = 60.0
    rate: float = 2.0

    def sessions(self, tok: Tokens) -> list[SimSession]:
        rng = np.random.default_rng([tok.seed, ARRIVALS])
        starts = _poisson(rng, self.users, self.rate)
        system = tok.run(self.system_len, SYSTEM)
        out = []
        for u, start in enumerate(starts.tolist()):
            messages = _lengths(rng, self.message_len, self.turns)
            answers = _lengths(rng, self.answer_len, self.turns)
            turns = [Turn((system if t == 0 else []) + tok.run(message, USER, u, t), answer)
                     for t, (message, answer) in enumerate(zip(messages, answers, strict=True))]
            think = (self.think_s * rng.uniform(0.5, 1.5, self.turns - 1)).tolist()
            out.append(SimSession(start, turns, think))
        return out


@dataclass
class ZipfGroups:
    """Single requests to ``groups`` shared system prompts, group ``g`` drawn with weight
    ``1 / (g + 1) ** zipf_s``, arriving at ``rate`` a second; each request's question is its own."""

    requests: int = 4000
    groups: int = 64
    zipf_s: float = 1.1
    system_len: int = 2048
    question_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (64, 256)
    rate: float = 10.0

    def sessions(self, tok: Tokens) -> list[SimSession]:
        rng = np.random.default_rng([tok.seed, ARRIVALS])
        weights = 1.0 / np.arange(1, self.groups + 1) ** self.zipf_s
        groups = rng.choice(self.groups, size=self.requests, p=weights / weights.sum()).tolist()
        systems = [tok.run(self.system_len, SYSTEM, g) for g in range(self.groups)]
        questions = _lengths(rng, self.question_len, self.requests)
        outputs = _lengths(rng, self.output_len, self.requests)
        starts = _poisson(rng, self.requests, self.rate).tolist()
        return [SimSession(start, [Turn(systems[g] + tok.run(q, QUESTION, g, i), n)], [])
                for i, (start, g, q, n) in enumerate(zip(starts, groups, questions, outputs,
                                                          strict=True))]


WORKLOADS = {"chat": ChatUsers, "groups": ZipfGroups}


def workload(name: str, options: dict[str, str]) -> ChatUsers | ZipfGroups:
    """The generated workload ``name`` with ``options`` (field name to text) set; ValueError
    names what is known."""
    if name not in WORKLOADS:
        raise ValueError(f"no generated workload {name!r} (known: {', '.join(WORKLOADS)})")
    cls = WORKLOADS[name]
    types = {f.name: f.type for f in fields(cls)}
    values: dict[str, object] = {}
    for key, text in options.items():
        if key not in types:
            raise ValueError(f"{name} has no option {key!r} (known: {', '.join(types)})")
        kind = types[key]
        if "tuple" in str(kind):
            low, _, high = text.partition("-")
            values[key] = (int(low), int(high or low))
        else:
            values[key] = (float if "float" in str(kind) else int)(text)
    return cls(**values)
