"""The tier-2 simulator's generated workloads: chat users whose turns resend the conversation
with the engine's own replies, and Zipf-popular groups, at a rate; and a chat run in simulated
time (no index: the pow2 policy)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from prefixserve.bench.load.workloads import Tokens
from prefixserve.bench.sim.simulate import (
    SimRequest,
    Simulator,
    engine_config,
    fresh,
    main,
    moved_share,
    parse_fraction,
    session_requests,
    simulate,
)
from prefixserve.bench.sim.workloads import ChatUsers, ZipfGroups, workload
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.sim.profiles import H100_LLAMA3_8B

PROFILE = H100_LLAMA3_8B
TOK = Tokens(PROFILE.vocab_size)


def chat(**options: object) -> list[SimRequest]:
    return session_requests(ChatUsers(**options).sessions(TOK), PROFILE.vocab_size)


def test_chat_turns_resend_the_conversation_with_the_replies() -> None:
    reqs = chat(users=3, turns=3, system_len=40, message_len=(5, 9), answer_len=(3, 6),
                think_s=10.0, rate=1.0)
    assert len(reqs) == 9 and [r.key for r in reqs] == list(range(9))
    system = list(reqs[0].tokens[:40])
    for user in range(3):
        first, second, third = reqs[3 * user : 3 * user + 3]
        assert list(first.tokens[:40]) == system  # one system prompt for every user
        assert 45 <= len(first.tokens) <= 49 and 3 <= first.output_len <= 6
        assert (first.after, second.after, third.after) == (None, first.key, second.key)
        assert first.reply and second.reply and not third.reply
        # the next turn: this prompt, its reply (output_len tokens), then a new message
        for before, after in ((first, second), (second, third)):
            reply = len(before.tokens) + before.output_len
            assert list(after.tokens[: len(before.tokens)]) == list(before.tokens)
            assert list(after.tokens[len(before.tokens) : reply]) == list(before.reply)
            assert 5 <= len(after.tokens) - reply <= 9
            assert 5.0 <= after.think_s <= 15.0
    # users arrive in order from 0; their later turns' arrivals come from the run
    starts = [reqs[3 * u].arrival_s for u in range(3)]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == 3
    # their messages differ
    assert reqs[0].tokens[40:] != reqs[3].tokens[40:]


def test_the_replies_resent_are_the_simulated_engines_own() -> None:
    """A run resends what the engine generated: the next turn hits the reply's blocks too."""
    reqs = chat(users=1, turns=2, system_len=64, message_len=(16, 16), answer_len=(48, 48),
                rate=1.0)
    config = EngineConfig(num_blocks=64, block_size=16)
    result = asyncio.run(simulate(reqs, PROFILE, 1, "round_robin", config, None))
    # turn 2's prompt: 64 + 16 + 48 reply + 16 = 144 tokens, of which turn 1 computed 127 (its
    # prompt and reply, less the last token sampled): 7 full blocks cached
    assert result.hit_rate == pytest.approx(112 / (80 + 144))
    assert result.ceiling_hit_rate == pytest.approx(112 / (80 + 144))


def test_a_later_turn_arrives_a_think_time_after_the_reply() -> None:
    reqs = chat(users=4, turns=3, system_len=32, message_len=(8, 16), answer_len=(4, 8),
                think_s=5.0, rate=2.0)
    config = engine_config(_args(), PROFILE, 256)
    sim = Simulator(PROFILE, 2, "pow2", config, None)
    ran = fresh(reqs)
    asyncio.run(sim.run(ran))
    by_key = {r.key: r for r in ran}
    for r in ran:
        assert r.finish_s is not None and r.first_token_s is not None
        if r.after is not None:
            assert r.arrival_s == pytest.approx(by_key[r.after].finish_s + r.think_s)
    assert 0.0 <= moved_share(ran) <= 1.0


def test_moved_share_counts_later_turns_sent_elsewhere() -> None:
    reqs = [SimRequest(0, [1], 1, 0.0, worker=0), SimRequest(1, [1], 1, 0.0, after=0, worker=0),
            SimRequest(2, [1], 1, 0.0, after=1, worker=1), SimRequest(3, [1], 1, 0.0, worker=1)]
    assert moved_share(reqs) == 0.5
    assert moved_share(reqs[3:]) == 0.0


def test_zipf_groups_favour_the_first_groups() -> None:
    groups = ZipfGroups(requests=2000, groups=8, system_len=32, question_len=(4, 8),
                        output_len=(2, 3), rate=100.0)
    sessions = groups.sessions(TOK)
    assert len(sessions) == 2000 and all(len(s.turns) == 1 for s in sessions)
    firsts = Counter(tuple(s.turns[0].tokens[:32]) for s in sessions)
    counts = sorted(firsts.values(), reverse=True)
    assert len(counts) == 8
    # Zipf(1.1) over 8: the first group about 2.1x the second, 9.8x the last
    assert 1.7 < counts[0] / counts[1] < 2.6 and counts[0] / counts[-1] > 6
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals == sorted(arrivals)
    assert 2000 / 100.0 * 0.9 < arrivals[-1] < 2000 / 100.0 * 1.1  # the rate holds


def test_workload_options_are_typed_and_checked() -> None:
    chat_users = workload("chat", {"users": "5", "rate": "0.5", "answer_len": "10-20"})
    assert isinstance(chat_users, ChatUsers)
    assert (chat_users.users, chat_users.rate, chat_users.answer_len) == (5, 0.5, (10, 20))
    assert workload("groups", {"question_len": "7"}).question_len == (7, 7)
    with pytest.raises(ValueError, match="no generated workload 'x'"):
        workload("x", {})
    with pytest.raises(ValueError, match=r"chat has no option 'size'.*users"):
        workload("chat", {"size": "1"})
    with pytest.raises(ValueError):
        workload("chat", {"users": "many"})


def test_the_command_line_refuses_a_bad_workload_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--workload", "chat", "--workload-option", "users=many"])
    assert exit_info.value.code == 2
    assert "invalid literal" in capsys.readouterr().err


@pytest.mark.parametrize("fraction", ["-0.1", "nan", "lots"])
def test_the_command_line_refuses_a_pool_fraction_below_zero_or_not_a_number(
        capsys, fraction: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--workload", "chat", "--pool-fraction", fraction])
    assert exit_info.value.code == 2
    assert "--pool-fraction" in capsys.readouterr().err
    assert parse_fraction("0.25") == 0.25 and parse_fraction("0") == 0.0


def _args():
    import argparse

    return argparse.Namespace(block_size=16, host_factor=1.0)
