"""Structured outputs in the engine: every constrained sample's text fits its constraint (JSON
schema, any JSON, regex, choice, EBNF grammar), with n>1, a prefix-cache hit, preemption and
logprobs; greedy runs are reproducible; bad constraints are refused naming their field. The
built-in random-weight model writes the tokens, so only the grammar keeps them in shape."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import time
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from prefixserve.router.sampling_params import SamplingParams, StructuredOutput
from prefixserve.workers import structured
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.compile_process import structural_tag
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.structured import compile_in_thread

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "nested": {"type": "object", "properties": {"on": {"type": "boolean"}},
                   "required": ["on"], "additionalProperties": False},
        "either": {"anyOf": [{"type": "boolean"}, {"enum": ["x", "y"]}]},
    }, "required": ["colour", "size", "nested"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
]


PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def eng() -> LLMEngine:
    return LLMEngine.from_pretrained(ensure_builtin_model(), EngineConfig(
        device="cpu", num_blocks=64, max_num_seqs=8))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(ensure_builtin_model() / "tokenizer.json"))


def run(eng: LLMEngine, tok: Tokenizer, kind: str, spec: str, **kw) -> list[tuple[str, str]]:
    """(text, finish reason) of each sample of one constrained request."""
    so = StructuredOutput(kind, spec, "response_format")
    grammar = eng.grammars.compile(so)
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 120), structured=so, **kw)
    rid = f"s-{id(params)}"
    eng.add_request(rid, PROMPT, params, None, None, grammar)
    samples: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    while rid in eng._requests:
        for out in eng.step():
            samples.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.index] = out.finish_reason
    return [(tok.decode(samples[i]), reasons[i]) for i in sorted(samples)]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_json_fits_its_schema(eng: LLMEngine, tok: Tokenizer, schema: dict,
                                      seed: int) -> None:
    for text, reason in run(eng, tok, "json", json.dumps(schema), temperature=1.0, seed=seed,
                            n=2, max_tokens=200):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_any_json_object(eng: LLMEngine, tok: Tokenizer) -> None:
    (text, reason), = run(eng, tok, "json", "", temperature=0.0, max_tokens=60)
    if reason == "stop":  # free JSON may outrun max_tokens: then "length", as in vLLM
        json.loads(text)
    assert text.lstrip()[:1] in "{["


def test_regex_choice_and_grammar(eng: LLMEngine, tok: Tokenizer) -> None:
    for text, reason in run(eng, tok, "regex", r"(yes|no)-[0-9]{3}", n=3, seed=7):
        assert reason == "stop" and re.fullmatch(r"(yes|no)-[0-9]{3}", text), text
    choices = ["alpha", "beta", "gamma delta"]
    for text, _ in run(eng, tok, "choice", json.dumps(choices), n=4, seed=3):
        assert text in choices
    grammar = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    for text, reason in run(eng, tok, "grammar", grammar, seed=5, max_tokens=40):
        assert re.fullmatch(r"\([0-9]+\)", text) or reason == "length", text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_grammar_wins_over_masks_that_leave_it_nothing(eng: LLMEngine, tok: Tokenizer,
                                                           temperature: float) -> None:
    """min_tokens past the grammar's end, allowed_token_ids outside every token it allows:
    the text still fits the constraint (it ends where the grammar does)."""
    choices = json.dumps(["yes", "no"])
    (text, reason), = run(eng, tok, "choice", choices, temperature=temperature, seed=1,
                          min_tokens=6, max_tokens=10)
    assert text in ("yes", "no") and reason == "stop"
    outside = tuple(tok.encode("qz").ids)
    (text, reason), = run(eng, tok, "choice", choices, temperature=temperature, seed=1,
                          allowed_token_ids=outside)
    assert text in ("yes", "no") and reason == "stop"


def test_greedy_is_reproducible_and_logprobs_follow_the_mask(eng: LLMEngine,
                                                            tok: Tokenizer) -> None:
    schema = json.dumps(SCHEMAS[1])
    first = run(eng, tok, "json", schema, temperature=0.0)
    assert run(eng, tok, "json", schema, temperature=0.0) == first  # a prefix hit the 2nd time
    so = StructuredOutput("json", schema)
    params = SamplingParams(max_tokens=200, temperature=0.0, logprobs=2, structured=so)
    out = eng.generate([PROMPT], params)[0].samples[0]
    assert tok.decode(out.token_ids) == first[0][0]
    assert all(lp.logprob > float("-inf") for lp in out.logprobs)  # sampled: allowed tokens


def test_preempted_samples_stay_in_shape(tok: Tokenizer) -> None:
    """A pool too small for every sample at once: some are preempted and recomputed."""
    small = LLMEngine.from_pretrained(ensure_builtin_model(), EngineConfig(
        device="cpu", num_blocks=12, block_size=16, max_num_seqs=8))
    results = run(small, tok, "json", json.dumps(SCHEMAS[1]), n=6, seed=11, max_tokens=100)
    assert small.stats().num_preemptions > 0
    for text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS[1])


@pytest.mark.parametrize(("kind", "spec", "says"), [
    ("json", "{not json", "response_format"),
    ("json", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "response_format"),
    ("regex", "(unclosed", "response_format"),
    ("grammar", "root ::= missing_rule", "response_format"),
    ("choice", "[]", "choice"),
    ("choice", "[1, 2]", "choice"),
    ("structural_tag", "[]", "a structural tag is a JSON object"),
    ("structural_tag", json.dumps({"structures": [{"begin": "<"}], "triggers": ["<"]}),
     "structures must be a list of"),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "nope"}}),
     "response_format"),
])
def test_bad_constraints_are_refused_naming_the_field(eng: LLMEngine, kind: str, spec: str,
                                                      says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says) as info:
        eng.grammars.compile(StructuredOutput(kind, spec, "response_format"))
    # the reason, without the time and C++ source place xgrammar's messages begin with
    assert not re.search(r"\.cc:[0-9]+|\[[0-9]{2}:[0-9]{2}", str(info.value)), info.value


async def test_compiling_runs_off_the_loop_within_its_time_limit(
        eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(structured=StructuredOutput("regex", "[a-z]+", "guided_regex"))
    assert await compile_in_thread(eng.compile, params) is not None
    with pytest.raises(InvalidRequestError, match="need a real model") as info:
        await compile_in_thread(None, params)  # a simulated engine cannot constrain
    assert info.value.param == "guided_regex"
    monkeypatch.setattr(structured, "WAIT_TIMEOUT_S", 0.05)

    def slow(p: SamplingParams) -> None:
        time.sleep(0.5)

    with pytest.raises(InvalidRequestError, match=r"not compiled within 0\.05 s") as info:
        await compile_in_thread(slow, params)
    assert info.value.param == "guided_regex"
    await asyncio.sleep(0.5)  # the slow one ends: the next test finds both threads free


async def test_compiles_run_two_at_a_time_and_queued_ones_give_up(
        eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two compiles run at once: behind two slow ones, a queued compile is refused when its
    time is up and never runs."""
    params = SamplingParams(structured=StructuredOutput("regex", "[a-z]+", "guided_regex"))
    ran: list[str] = []

    def slow(p: SamplingParams) -> None:
        ran.append("slow")
        time.sleep(0.6)

    def quick(p: SamplingParams) -> str:
        ran.append("quick")
        return "compiled"

    assert await compile_in_thread(quick, params) == "compiled"  # the threads are free again
    ran.clear()
    monkeypatch.setattr(structured, "WAIT_TIMEOUT_S", 0.2)
    results = await asyncio.gather(
        compile_in_thread(slow, params), compile_in_thread(slow, params),
        compile_in_thread(quick, params), return_exceptions=True)
    assert all(isinstance(r, InvalidRequestError) for r in results)
    await asyncio.sleep(0.6)  # the slow ones end; the queued one was dropped, not run late
    assert ran == ["slow", "slow"]
    assert await compile_in_thread(quick, params) == "compiled"


# Sixteen string patterns with a long bounded repetition: xgrammar compiles each for seconds
# even over the built-in model's 264-token vocabulary (~3 s each on a 2-vCPU EPYC, ~48 s in
# all: far past the test's limit on a faster machine too).
RUNAWAY = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"^([a-z{c}]{{3,40}}[0-9]{{2,9}}){{5,1000}}$"}
    for i, c in enumerate("ABCDEFGHIJKLMNOP")}, "required": [f"p{i}" for i in range(16)]}


def _compile_children() -> set[int]:
    """This process's live compile children."""
    found = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            fields = Path(proc, "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(proc, "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"compile_process" in cmdline:
            found.add(int(proc.split("/")[2]))
    return found


async def test_a_runaway_compile_is_stopped_at_its_limit(
        eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile is killed with its child process when its time is up, and a fresh child
    compiles the next constraint; meanwhile the other compile thread serves the others."""
    grammars = eng.grammars
    assert grammars is not None
    quick = SamplingParams(structured=StructuredOutput("regex", "[0-9]+", "guided_regex"))
    assert await compile_in_thread(eng.compile, quick) is not None  # a child is up
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 6.0)
    runaway = SamplingParams(structured=StructuredOutput("json", json.dumps(RUNAWAY),
                                                         "response_format"))
    task = asyncio.ensure_future(compile_in_thread(eng.compile, runaway))
    await asyncio.sleep(0.5)
    during = _compile_children()
    other = SamplingParams(structured=StructuredOutput("regex", "[a-f]+", "guided_regex"))
    assert await compile_in_thread(eng.compile, other) is not None  # beside the runaway
    with pytest.raises(InvalidRequestError, match="did not compile within 6 s") as info:
        await task
    assert info.value.param == "response_format"
    deadline = time.monotonic() + 10  # the request's 400 may come just before the kill
    while len(after := _compile_children()) < len(during) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(during - after) == 1  # the runaway's child was killed, and reaped
    assert len(after) == len(during)  # ... and replaced at once
    assert set(grammars.child_pids()) <= after
    again = SamplingParams(structured=StructuredOutput("regex", "[g-k]+", "guided_regex"))
    assert await compile_in_thread(eng.compile, again) is not None


def test_structural_tags_hold_each_tagged_section(eng: LLMEngine, tok: Tokenizer) -> None:
    """Free text, and after each trigger a tag whose content fits its schema. The model is
    pushed to write the trigger wherever it may (a logit bias), so it opens tag after tag; every
    section it closes is valid. vLLM's first shape and xgrammar's format alike."""
    schema = SCHEMAS[0]
    opener = tok.encode("<", add_special_tokens=False).ids[-1]
    legacy = {"structures": [{"begin": "<", "schema": schema, "end": ">"}], "triggers": ["<"]}
    current = json.loads(structural_tag(json.dumps(legacy)))
    assert current["format"]["type"] == "triggered_tags"
    for spec in (legacy, current):
        [(text, _)] = run(eng, tok, "structural_tag", json.dumps(spec), temperature=0,
                          logit_bias={opener: 100.0}, max_tokens=60)
        sections = re.findall(r"<([^<>]*)>", text)
        assert text.startswith("<") and len(sections) >= 2, text
        for section in sections:
            jsonschema.validate(json.loads(section), schema)
