"""The block-hash chain against an independent SHA-256 reference: exact digests, edge cases."""

from __future__ import annotations

import hashlib

import pytest

from prefixserve.router.blocks import (
    DEFAULT_BLOCK_SIZE,
    ROOT,
    BlockHasher,
    Chain,
    ChainMemo,
    _u32,
    hash_block,
    hash_chain,
    namespace,
)


def le32(value: int) -> bytes:
    """Little-endian u32, written without ``struct`` (an independent encoder)."""
    return value.to_bytes(4, "little")


def ref_namespace(fp: str, salt: str | None) -> bytes:
    body = b"PSN1" + le32(len(fp.encode())) + fp.encode()
    if salt is None:
        body += b"\x00" + le32(0)
    else:
        body += b"\x01" + le32(len(salt.encode())) + salt.encode()
    return hashlib.sha256(body).digest()[:16]


def ref_block(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    body = b"".join(le32(t) for t in tokens)
    payload = b"PSB1" + parent + le32(len(tokens)) + body + le32(len(extra)) + extra
    return hashlib.sha256(payload).digest()[:16]


def ref_chain(tokens: list[int], bs: int, ns: bytes = b"") -> list[bytes]:
    out: list[bytes] = []
    for start in range(0, len(tokens) - bs + 1, bs):
        block = tokens[start:start + bs]
        out.append(ref_block(out[-1], block) if out else ref_block(ROOT, block, ns))
    return out


def test_root_and_u32_layout() -> None:
    assert hashlib.sha256(b"prefixserve/block-hash/v1/root").digest()[:16] == ROOT
    assert _u32(0) == b"\x00\x00\x00\x00"
    assert _u32(0x01020304) == b"\x04\x03\x02\x01"
    assert _u32(2**32 - 1) == b"\xff\xff\xff\xff"


@pytest.mark.parametrize(
    ("fp", "salt"),
    [("m", None), ("m", ""), ("m", "tenant"), ("", None), ("modèle", "sél")],
)
def test_namespace_matches_reference(fp: str, salt: str | None) -> None:
    assert namespace(fp, salt) == ref_namespace(fp, salt)
    assert len(namespace(fp, salt)) == 16


def test_namespace_default_salt_is_none_and_empty_salt_differs() -> None:
    assert namespace("m") == namespace("m", None) == ref_namespace("m", None)
    assert namespace("m", "") != namespace("m")
    assert namespace("a", "b") != namespace("ab")


def test_hash_block_matches_reference() -> None:
    parent = bytes(range(16))
    assert hash_block(parent, [1, 2, 3]) == ref_block(parent, [1, 2, 3])
    assert hash_block(parent, [1, 2, 3], b"ns") == ref_block(parent, [1, 2, 3], b"ns")
    assert hash_block(parent, []) == ref_block(parent, [])
    assert hash_block(parent, [2**32 - 1, 0]) == ref_block(parent, [2**32 - 1, 0])
    # default extra is empty, not some other constant
    assert hash_block(parent, [5]) == hash_block(parent, [5], b"")


@pytest.mark.parametrize("size", [0, 15, 17, 32])
def test_hash_block_rejects_bad_parent(size: int) -> None:
    with pytest.raises(ValueError) as info:
        hash_block(b"\x00" * size, [1])
    assert str(info.value) == f"parent digest must be 16 bytes, got {size}"


@pytest.mark.parametrize("token", [-1, 2**32, 1.5])
def test_hash_block_rejects_bad_tokens(token: object) -> None:
    with pytest.raises(ValueError) as info:
        hash_block(ROOT, [1, token])  # type: ignore[list-item]
    assert str(info.value).startswith("token ids must be integers in [0, 2**32): ")
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_hash_chain_matches_reference() -> None:
    ns = namespace("fp", "salt")
    tokens = [7 * i % 1000 for i in range(53)]
    for bs in (1, 4, 16):
        assert hash_chain(tokens, bs, ns) == ref_chain(tokens, bs, ns)
    # defaults: 16-token blocks, empty namespace
    assert DEFAULT_BLOCK_SIZE == 16
    assert hash_chain(tokens) == ref_chain(tokens, 16, b"")
    assert len(hash_chain(tokens)) == 3


def test_chain_links_each_block_to_the_previous_one() -> None:
    # identical blocks: chaining off hashes[0] instead of hashes[-1] would repeat digests
    tokens = [3] * 16
    hashes = hash_chain(tokens, 4, b"")
    assert len(set(hashes)) == 4
    assert hashes[2] == ref_block(hashes[1], [3] * 4)
    assert hashes[3] == ref_block(hashes[2], [3] * 4)


def test_namespace_only_enters_block_zero() -> None:
    ns = namespace("fp")
    a, b = hash_chain(list(range(8)), 4, ns), hash_chain(list(range(8)), 4, b"")
    assert a[0] == ref_block(ROOT, [0, 1, 2, 3], ns) != b[0]
    assert a[1] == ref_block(a[0], [4, 5, 6, 7])  # no extra after block 0


def test_incremental_appends_equal_one_shot() -> None:
    ns = namespace("fp")
    tokens = list(range(100, 131))
    hasher = BlockHasher(8, ns)
    assert hasher.block_size == 8 and hasher.namespace == ns
    got: list[list[bytes]] = [hasher.append(tokens[i:i + 3]) for i in range(0, len(tokens), 3)]
    expected = ref_chain(tokens, 8, ns)
    assert [h for new in got for h in new] == expected
    assert hasher.hashes == expected
    # a block is reported by exactly the append that completed it
    assert [len(new) for new in got] == [0, 0, 1, 0, 0, 1, 0, 1, 0, 0, 0]
    assert hasher.num_tokens == 31
    assert hasher._pending == tokens[24:]


def test_one_append_can_complete_several_blocks() -> None:
    hasher = BlockHasher(2)
    assert hasher.append([1]) == []
    assert hasher.num_tokens == 1
    new = hasher.append([2, 3, 4, 5, 6])
    assert new == ref_chain([1, 2, 3, 4, 5, 6], 2)
    assert hasher.num_tokens == 6
    assert hasher.append([]) == []
    assert hasher.hashes == new


def test_block_hasher_defaults_and_bounds() -> None:
    hasher = BlockHasher()
    assert hasher.block_size == 16 and hasher.namespace == b""
    assert hasher.hashes == [] and hasher.num_tokens == 0
    assert BlockHasher(1).append([9]) == [ref_block(ROOT, [9])]
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"^block_size must be >= 1$"):
            BlockHasher(bad)


RUN = ChainMemo.RUN_BLOCKS


def test_a_chain_holds_its_digests_packed() -> None:
    digests = [bytes([k]) * 16 for k in range(5)]
    chain = Chain.of(digests)
    assert chain.packed == b"".join(digests) and len(chain) == 5
    assert chain[0] == digests[0] and chain[-5] == digests[0]
    assert chain[4] == chain[-1] == digests[4]
    for bad in (5, -6):
        with pytest.raises(IndexError):
            chain[bad]
    assert list(chain) == digests and chain == digests and chain != digests[:4]
    assert chain[1:3] == digests[1:3] and isinstance(chain[1:3], Chain)
    assert chain[3:1] == [] and chain[::2] == digests[::2] and chain[-2:] == digests[-2:]
    assert chain != b"".join(digests) and Chain() == [] and not Chain()
    held = chain  # a holder of the object sees it grow
    chain.extend(digests[:2])
    chain.extend(Chain.of(digests[2:3]))
    assert held == [*digests, *digests[:3]] and len(held) == 8
    assert Chain.of(chain) == chain and Chain(chain.packed) == chain
    for wrong in ([b"x" * 15], [b"x" * 17], [b"x" * 15, b"x" * 17]):
        with pytest.raises(ValueError, match="16 bytes each"):
            Chain.of(wrong)
    with pytest.raises(ValueError, match="multiple of 16"):
        Chain(b"x" * 20)
    with pytest.raises(TypeError):
        hash(chain)




def test_chain_memo_equals_hashing_for_every_shape() -> None:
    ns = namespace("fp", "salt")
    memo = ChainMemo(2)
    base = [(31 * i) % 997 for i in range(2 * RUN * 5 + 7)]
    # shorter than a run, exactly runs, runs plus blocks plus a partial block, then extensions
    # and divergences of the prompts before (hits of whole runs and of none)
    for n in (0, 1, 2 * RUN - 1, 2 * RUN, 2 * RUN * 2, len(base)):
        assert memo.chain(base[:n], ns) == ref_chain(base[:n], 2, ns)
    longer = base + [5, 6, 7] * 40
    assert memo.chain(longer, ns) == ref_chain(longer, 2, ns)
    forked = [*base[: 2 * RUN * 3 + 1], 999, *base[2 * RUN * 3 + 2 :]]
    assert memo.chain(forked, ns) == ref_chain(forked, 2, ns)
    assert memo.chain(base, b"") == ref_chain(base, 2, b"")


def test_chain_memo_reuses_whole_runs_it_hashed_before() -> None:
    ns = namespace("fp")
    memo = ChainMemo(2)
    first = list(range(2 * RUN * 3 + 2 * 5 + 1))  # three runs, five blocks, one token
    memo.chain(first, ns)
    assert memo.hit_blocks == 0
    assert memo.num_runs == 3  # the five blocks after the runs make no whole run
    memo.chain(first + list(range(500, 600)), ns)
    assert memo.hit_blocks == 3 * RUN  # the three runs
    memo.chain(first[: 2 * RUN * 2 + 3], ns)
    assert memo.hit_blocks == 5 * RUN
    changed = first.copy()
    changed[2 * RUN + 1] = 12345  # the second run differs: only the first is reused
    assert memo.chain(changed, ns) == ref_chain(changed, 2, ns)
    assert memo.hit_blocks == 6 * RUN
    memo.chain(first, namespace("other"))  # another namespace shares nothing
    assert memo.hit_blocks == 6 * RUN


def test_chain_memo_budget_hashes_what_it_remembers_and_so_many_more() -> None:
    ns = namespace("fp")
    memo = ChainMemo(2)
    tokens = [(7 * i) % 501 for i in range(2 * RUN * 40 + 3)]  # 40 runs: past one window
    full = ref_chain(tokens, 2, ns)
    assert memo.chain(tokens, ns, budget=5) == full[:5]  # nothing remembered: five blocks
    assert memo.chain(tokens, ns, budget=RUN + 3) == full[: RUN + 3]
    assert memo.hit_blocks == 0  # the first five were no whole run
    assert memo.chain(tokens, ns, budget=3) == full[: RUN + 3]  # one run remembered, then 3
    assert memo.hit_blocks == RUN
    assert memo.chain(tokens, ns, budget=0) == full[:RUN]
    assert memo.chain(tokens, ns) == full  # no budget: every block
    assert memo.chain(tokens, ns, budget=1) == full  # all remembered but the last partial run
    assert memo.chain(tokens[: 2 * RUN - 1], ns, budget=1) == full[:1]  # shorter than a run
    window = RUN * ChainMemo.WINDOW_RUNS
    fresh = ChainMemo(2)
    other = [t + 1 for t in tokens]  # nothing of it remembered: hashed a window at a time
    assert fresh.chain(other, ns, budget=window + 1) == ref_chain(other, 2, ns)[: window + 1]
    assert fresh.chain(other, ns, budget=window - 1) == ref_chain(other, 2, ns)[: 2 * window - 1]
    assert ChainMemo(2, max_runs=0).chain(tokens, ns, budget=7) == full[:7]


def test_chain_memo_resumes_at_the_last_whole_run_of_what_is_known() -> None:
    ns = namespace("fp")
    memo = ChainMemo(2)
    tokens = [(11 * i) % 503 for i in range(2 * RUN * 20 + 5)]  # 20 runs, two blocks, a token
    full = ref_chain(tokens, 2, ns)
    first = memo.chain(tokens, ns, budget=3 * RUN + 4)  # a decision's part: 3 runs, 4 blocks
    assert first == full[: 3 * RUN + 4] and memo.hit_blocks == 0
    # the rest, given that part: its three whole runs are kept, not looked up again; the four
    # blocks after them are hashed again (a partial run is remembered nowhere)
    assert memo.chain(tokens, ns, known=first) == full
    assert memo.hit_blocks == 0
    assert memo.chain(tokens, ns, known=full) == full
    assert memo.hit_blocks == 0  # all 20 whole runs known: only the last two blocks hashed
    bogus = [*full[:RUN], b"?" * 16]  # a digest past the last whole run is not trusted
    assert memo.chain(tokens, ns, known=bogus) == full
    assert memo.hit_blocks == 19 * RUN  # from the second run on, every run is remembered
    assert memo.chain(tokens, ns, budget=2, known=full[:RUN]) == full  # nothing more to hash
    assert ChainMemo(2).chain(tokens, ns, budget=1, known=full[: 2 * RUN]) == full[: 2 * RUN + 1]


def test_chain_memo_stops_at_the_limit() -> None:
    ns = namespace("fp")
    tokens = [(5 * i) % 499 for i in range(2 * RUN * 6)]
    full = ref_chain(tokens, 2, ns)
    memo = ChainMemo(2)
    assert memo.chain(tokens, ns, limit=2 * RUN * 3 + 3) == full[: 3 * RUN + 1]
    assert memo.chain(tokens, ns, limit=len(tokens)) == full
    assert memo.chain(tokens, ns, budget=3, limit=2 * RUN * 2) == full[: 2 * RUN]
    off = ChainMemo(2, max_runs=0)
    assert off.chain(tokens, ns, budget=50, limit=2 * 7 + 1) == full[:7]
    assert off.chain(tokens, ns, budget=5, limit=2 * 7 + 1) == full[:5]
    assert off.chain(tokens, ns, limit=2 * 7 + 1) == full[:7]


def test_chain_memo_keeps_two_generations() -> None:
    memo = ChainMemo(1, max_runs=1)
    a, b, c = ([k] * RUN for k in (1, 2, 3))  # one run each
    memo.chain(a)
    memo.chain(b)  # a moves to the old generation
    memo.chain(a)  # a hit in the old one: back to the young one, b to the old
    assert memo.hit_blocks == RUN
    memo.chain(c)  # the young one (a) turns old; b is dropped
    memo.chain(b)
    assert memo.hit_blocks == RUN
    memo.chain(c)
    assert memo.hit_blocks == 2 * RUN  # c was old, b young again: both still held
    memo.chain(c)  # young now: b turns old
    memo.chain(b)
    assert memo.hit_blocks == 4 * RUN  # a promoted run is found again after a turn
    short = ChainMemo(1)
    short.chain(list(range(2 * RUN - 1)))  # a run and all but one block of another
    assert short.num_runs == 1
    off = ChainMemo(1, max_runs=0)
    assert off.chain(a) == off.chain(a) == ref_chain(a, 1)
    assert off.hit_blocks == 0


def test_chain_memo_bounds() -> None:
    memo = ChainMemo()
    assert memo.block_size == DEFAULT_BLOCK_SIZE and memo.max_runs == 16384
    for bad in ({"block_size": 0}, {"max_runs": -1}):
        with pytest.raises(ValueError, match=r"^block_size must be >= 1 and max_runs >= 0$"):
            ChainMemo(**bad)
