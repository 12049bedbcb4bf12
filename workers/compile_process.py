"""Grammars compiled in a child process, so that a compile past its time limit can be stopped.

xgrammar cannot cancel a compile once it runs, and some constraints are built to compile for a
minute (a schema of 20 strings of `maxLength` 200: ~54 s). Run in the engine's process, such a
compile would hold a core, and every compile queued behind it, long after its request got its
400. In a child process it is stopped by killing the process, and a fresh one starts at once
for the next compile. The child runs at a lower CPU priority than the engine, so compiling
slows the engine's steps little.

Requests and answers cross the child's stdin and stdout as length-prefixed msgpack frames: the
vocabulary once (xgrammar's `TokenizerInfo`, serialized), then a constraint per request, and
back a compiled grammar as xgrammar's JSON serialization (~80 KB for a small schema over a 49 K
vocabulary; it deserializes in ~5 ms) or an error's first line. Torch-free until the child
imports xgrammar.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import sys
import time
from typing import IO, Any

import msgpack

CHILD_NICENESS = 10  # the child's `nice` increment: the engine's threads come first
START_TIMEOUT_S = 60.0  # a fresh child imports xgrammar and torch (~3 s on 2 cores)
_HEADER = 4  # bytes of a frame's length
# xgrammar's errors begin `[18:38:04] /project/cpp/json_schema_converter.cc:5082: `
_SOURCE_PLACE = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class CompileError(Exception):
    """The constraint does not compile (its message is xgrammar's first line)."""


class CompileTimeout(Exception):
    """The compile ran past its time limit; the child was killed."""


def choice_grammar(spec: str) -> str:
    """EBNF for "exactly one of these strings" (`spec`: a JSON list of strings)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError:
        choices = None
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def structural_tag(spec: str) -> str:
    """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), as JSON text.
    vLLM's first shape, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`,
    becomes the format it stands for: free text, and after a trigger one of the tags, its
    content held to its schema."""
    tag = json.loads(spec)
    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object")
    if "structures" not in tag:
        return spec
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(structures, list) and isinstance(triggers, list) and all(
            isinstance(s, dict) and isinstance(s.get("begin"), str)
            and isinstance(s.get("end"), str) and isinstance(s.get("schema"), dict | bool)
            for s in structures)):
        raise ValueError("structures must be a list of {begin, schema, end} and triggers a "
                         "list of strings")
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": s["schema"]}}
            for s in structures]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags}})


def build_grammar(compiler: Any, kind: str, spec: str) -> Any:
    """A constraint (router/sampling_params.py's kinds) compiled by an xgrammar compiler."""
    if kind == "json":
        if not spec:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec))
    if kind == "structural_tag":
        return compiler.compile_structural_tag(structural_tag(spec))
    return compiler.compile_grammar(spec)


def first_line(exc: BaseException) -> str:
    """The error's first line, without the time and C++ source place xgrammar's messages start
    with (a client reads the reason, not our build's paths)."""
    text = str(exc).strip() or type(exc).__name__
    return _SOURCE_PLACE.sub("", text.splitlines()[0])[:500]


def _write_frame(out: IO[bytes], message: dict[str, Any]) -> None:
    data = msgpack.packb(message)
    out.write(len(data).to_bytes(_HEADER, "big") + data)
    out.flush()


class CompileProcess:
    """One child process compiling grammars for one vocabulary, one at a time."""

    def __init__(self, tokenizer_info: str, cache_bytes: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "prefixserve.workers.compile_process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out, self._in = self._proc.stdin, self._proc.stdout.fileno()
        _write_frame(self._out, {"tokenizer_info": tokenizer_info, "cache_bytes": cache_bytes})
        self._started = False  # the child said it is ready

    @property
    def pid(self) -> int:
        return self._proc.pid

    def compile(self, kind: str, spec: str, timeout_s: float) -> str:
        """The compiled grammar, serialized; past `timeout_s` of compiling (the child's start
        not counted) the child is killed and CompileTimeout raised."""
        try:
            if not self._started:
                self._read(time.monotonic() + START_TIMEOUT_S)
                self._started = True
            _write_frame(self._out, {"kind": kind, "spec": spec})
            reply = self._read(time.monotonic() + timeout_s)
        except (TimeoutError, EOFError, OSError) as exc:
            self.kill()
            if isinstance(exc, TimeoutError):
                raise CompileTimeout from None
            raise CompileError("the compiler process failed on this constraint") from None
        if "error" in reply:
            raise CompileError(reply["error"])
        return reply["grammar"]

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read(self, deadline: float) -> dict[str, Any]:
        size = int.from_bytes(self._read_exactly(_HEADER, deadline), "big")
        return msgpack.unpackb(self._read_exactly(size, deadline))

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self._in, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)


def _read_frame(source: IO[bytes]) -> dict[str, Any] | None:
    header = source.read(_HEADER)
    if len(header) < _HEADER:
        return None  # the parent closed the pipe: it is gone or done with us
    return msgpack.unpackb(source.read(int.from_bytes(header, "big")))


def main() -> None:
    """The child: frames in on stdin, out on the real stdout (fd 1 then points at stderr, so
    nothing a library prints can break a frame). It ends when its parent closes the pipe."""
    with contextlib.suppress(BrokenPipeError):  # the parent went away mid-answer
        _serve()


def _serve() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    source = sys.stdin.buffer
    init = _read_frame(source)
    if init is None:
        return
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=init["cache_bytes"])
    os.nice(CHILD_NICENESS)  # after start-up: a first request does not wait on a slow import
    _write_frame(out, {"ready": True})
    while (request := _read_frame(source)) is not None:
        try:
            grammar = build_grammar(compiler, request["kind"], request["spec"])
            reply = {"grammar": grammar.serialize_json()}
        except Exception as exc:  # the client's constraint: its error goes back
            reply = {"error": first_line(exc)}
        _write_frame(out, reply)


if __name__ == "__main__":
    main()
