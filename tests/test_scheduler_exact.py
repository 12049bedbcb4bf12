"""Scheduler decisions, exactly: prefill/decode accounting, counters, backlog, retirement."""

from __future__ import annotations

from router.blocks import BlockHasher
from workers.kv_cache import KVCacheManager
from workers.sampling import SamplingParams
from workers.scheduler import Scheduler, SchedulerOutput, SeqStatus, Sequence

BS = 4
NS = b"\x01" * 16


def seq(name: str, n: int, first: int = 0, request: str | None = None) -> Sequence:
    """A waiting sequence with an ``n``-token prompt ``first, first + 1, ...``."""
    tokens = list(range(first, first + n))
    hasher = BlockHasher(BS, NS)
    hasher.append(tokens)
    return Sequence(name, request or name, 0, tokens, n, SamplingParams(), hasher)


def advance(out: SchedulerOutput, sample: int = 7) -> None:
    """Pretend the forward pass ran: count the tokens, append a sample where a row is done."""
    for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(sample)


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 100) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget)


def test_sequence_views() -> None:
    s = seq("a", 9)
    assert s.num_tokens == 9 and s.num_output_tokens == 0
    assert s.hashes == s.hasher.hashes and len(s.hashes) == 2
    assert s.status is SeqStatus.WAITING and s.num_cached_tokens == -1
    s.append_token(5)
    s.append_token(6)
    s.append_token(7)
    assert s.token_ids[-3:] == [5, 6, 7]
    assert s.num_tokens == 12 and s.num_output_tokens == 3
    assert len(s.hashes) == 3  # the appended tokens completed block 2
    assert SchedulerOutput([], []).empty and not SchedulerOutput([s], [1]).empty


def test_new_scheduler_is_idle_and_counts_nothing() -> None:
    sched = scheduler()
    assert not sched.has_unfinished()
    assert sched.num_preemptions == 0
    assert sched.prompt_tokens_queried == 0 and sched.prompt_tokens_hit == 0
    assert sched.queued_prefill_tokens() == 0
    assert sched.schedule().empty


def test_has_unfinished_with_only_waiting_or_only_running() -> None:
    sched = scheduler()
    a = seq("a", 5)
    sched.add(a)
    assert list(sched.waiting) == [a] and sched.running == []
    assert sched.has_unfinished()
    advance(sched.schedule())
    assert sched.running == [a] and not sched.waiting
    assert sched.has_unfinished()
    sched.finish(a, "stop")
    assert not sched.has_unfinished()


def test_prefill_and_decode_token_accounting() -> None:
    sched = scheduler(budget=12)
    a, b, c = seq("a", 5), seq("b", 6, 100), seq("c", 9, 200)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # a whole (5), b whole (6), c a 1-token chunk: all prompt work, none of it decode
    assert out.num_new_tokens == [5, 6, 1]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (12, 0)
    advance(out)
    out = sched.schedule()
    # a and b decode one token each; c continues its prompt with the remaining 8
    assert [s.seq_id for s in out.seqs] == ["a", "b", "c"]
    assert out.num_new_tokens == [1, 1, 8]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (8, 2)
    advance(out)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 1, 1]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 3)


def test_last_prompt_token_alone_is_prefill() -> None:
    sched = scheduler(budget=4)
    a = seq("a", 5)
    sched.add(a)
    advance(sched.schedule())  # 4 of 5
    out = sched.schedule()
    assert out.num_new_tokens == [1]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 0)


def test_preempted_sequence_is_preempted_again_and_recomputes() -> None:
    kv = KVCacheManager(7, BS, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, x, b = seq("a", 4), seq("x", 4, 50), seq("b", 4, 100)
    for s in (a, x, b):
        sched.add(s)
    preempted_at: list[int] = []
    for step in range(11):
        out = sched.schedule()
        if out.preempted:
            assert out.preempted == [b]  # always the newest running sequence
            preempted_at.append(step)
            if x.status is SeqStatus.RUNNING:
                sched.finish(x, "stop")  # makes room for b to come back
        if step == 6:
            # b recomputes prompt + its 5 outputs: prefill work, though outputs exist
            assert out.seqs == [a, b] and out.num_new_tokens == [1, 9]
            assert b.num_output_tokens == 5
            assert (out.num_prefill_tokens, out.num_decode_tokens) == (9, 1)
        advance(out)
    assert preempted_at == [5, 10]
    assert b.num_preemptions == 2 and sched.num_preemptions == 2
    assert a.num_preemptions == 0 and x.num_preemptions == 0
    assert b.status is SeqStatus.WAITING and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and "b" not in kv.tables
    # its prompt was counted at its first admission only
    assert sched.prompt_tokens_queried == 12 and b.num_cached_tokens == 0


def test_recompute_after_a_full_prefix_hit_is_one_decode_row() -> None:
    kv = KVCacheManager(3, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", 4), seq("b", 4, 100)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # a, b: 1 block each, one token sampled each
    out = sched.schedule()  # both need a 2nd block, one is left: b (newest) is preempted
    assert out.preempted == [b] and out.seqs == [a]
    advance(out)
    sched.finish(a, "stop")
    out = sched.schedule()
    # b's prompt block is still cached: only its sampled token is recomputed
    assert out.seqs == [b] and out.num_new_tokens == [1]
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 0
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)


def test_prompt_hit_counters() -> None:
    sched = scheduler()
    a = seq("a", 10)
    sched.add(a)
    advance(sched.schedule())
    assert (sched.prompt_tokens_queried, sched.prompt_tokens_hit) == (10, 0)
    b = seq("b", 10)  # same prompt: blocks 0 and 1 are hits (block 2 holds its last token)
    sched.add(b)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert (sched.prompt_tokens_queried, sched.prompt_tokens_hit) == (20, 8)


def test_backlog_counts_every_running_prompt_left() -> None:
    sched = scheduler(budget=12)
    a, b = seq("a", 10), seq("b", 10, 100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.num_new_tokens == [10, 2]
    # the step failed (nothing advanced): both running prompts are still to compute
    assert sched.queued_prefill_tokens() == 20
    advance(out)
    # a is decoding (1 left: not prefill work); b has 8 left
    assert sched.queued_prefill_tokens() == 8


def test_backlog_counts_two_tokens_left() -> None:
    sched = scheduler(budget=8)
    a = seq("a", 10)
    sched.add(a)
    advance(sched.schedule())
    assert a.num_tokens - a.num_computed_tokens == 2
    assert sched.queued_prefill_tokens() == 2


def test_finish_running_and_waiting() -> None:
    sched = scheduler(budget=5)
    a, b, c = seq("a", 5), seq("b", 5, 100), seq("c", 5, 200)
    for s in (a, b, c):
        sched.add(s)
    advance(sched.schedule())  # a runs; b and c wait
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    sched.finish(b, "abort")
    assert list(sched.waiting) == [c] and sched.running == [a]
    assert b.status is SeqStatus.FINISHED and b.finish_reason == "abort"
    sched.finish(a, "length")
    assert sched.running == [] and list(sched.waiting) == [c]
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "length"
    assert "a" not in sched.kv.tables and sched.kv.num_free_blocks == 64


def test_drop_requests_retires_only_those_requests() -> None:
    sched = scheduler(budget=12)
    r1a, r1b = seq("r1a", 5, 0, "r1"), seq("r1b", 5, 100, "r1")
    r2, r3 = seq("r2", 5, 200, "r2"), seq("r3", 5, 300, "r3")
    for s in (r1a, r2, r1b, r3):
        sched.add(s)
    advance(sched.schedule())  # r1a, r2 run (10 of 12); r1b gets 2, r3 waits
    assert sched.running == [r1a, r2, r1b] and list(sched.waiting) == [r3]
    r2.status, r2.finish_reason = SeqStatus.FINISHED, "stop"  # finished by the failed step
    sched.drop_requests({"r1", "r2"})
    assert sched.running == [] and list(sched.waiting) == [r3]
    assert [s.finish_reason for s in (r1a, r1b, r2)] == ["abort", "abort", "stop"]
    assert all(s.status is SeqStatus.FINISHED for s in (r1a, r1b, r2))
    assert r3.status is SeqStatus.WAITING and r3.finish_reason is None
    assert sched.kv.tables == {} and sched.kv.num_free_blocks == 64
    sched.add(seq("r4", 5, 400, "r4"))
    advance(sched.schedule())
    sched.drop_requests({"r3"})
    assert [s.seq_id for s in sched.running] == ["r4"] and not sched.waiting
    assert list(sched.kv.tables) == ["r4"]


def test_remove_finished_keeps_the_others_in_order() -> None:
    sched = scheduler()
    seqs = [seq(f"s{i}", 3, 10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    advance(sched.schedule())
    sched.remove_finished(set())
    assert sched.running == seqs
    sched.remove_finished({seqs[1], seqs[3]})
    assert sched.running == [seqs[0], seqs[2]]
