"""Fuzz a running prefixserve endpoint from its own OpenAPI schema (schemathesis + Hypothesis).

Every operation gets valid (positive) and invalid (negative) requests. Nothing may answer a 5xx
its operation does not document (`/ready`'s 503 is its answer while workers cannot serve), and
every 4xx must be OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`.
Generation lengths are clamped (`max_tokens` <= 4, `n` <= 2) so that a case costs milliseconds,
not a long generation: the point is the input handling. The first body an operation accepts is
then sent again with each top-level field replaced by oversized numbers: 5,000-digit integers
and digit strings, as values, list items and object keys (Python's int() refuses past 4,300
digits, so a field parsed late would answer 500). Example::

    python -m prefixserve.bench.load.fuzz_api --base-url http://127.0.0.1:8000 --max-examples 500

prints the case count, the 5xx count and the first failures; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as fix_seed
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode

ENVELOPE_KEYS = {"message", "type", "param", "code"}
MAX_FUZZ_TOKENS = 4
MAX_FUZZ_N = 2
HUGE_DIGITS = "9" * 5000
_HOLE = "\u0000huge\u0000"  # a JSON string no body holds, replaced by raw JSON text
# Raw JSON for a field's value: numbers and digit strings past every parser's limit.
OVERSIZED_VALUES = (
    HUGE_DIGITS,
    "-" + HUGE_DIGITS,
    f'"{HUGE_DIGITS}"',
    f'{{"{HUGE_DIGITS}": 1}}',
    f'["{HUGE_DIGITS}"]',
    f"[{HUGE_DIGITS}]",
    f"0.{HUGE_DIGITS}e{HUGE_DIGITS}",
)


@dataclass
class FuzzReport:
    cases: int = 0
    server_errors: int = 0  # 5xx
    bad_envelopes: int = 0  # 4xx not in OpenAI's error envelope
    oversized: int = 0  # of the cases: bodies with oversized numbers
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few, for the log

    @property
    def ok(self) -> bool:
        return self.server_errors == 0 and self.bad_envelopes == 0

    def record(self, case: Case | str, status: int, body: bytes,
               documented: frozenset[int] = frozenset()) -> None:
        """One answer: `case` as generated, or a description of a hand-made body; `documented`:
        the statuses its operation's schema lists (a documented 5xx is an answer, not a
        failure)."""
        self.cases += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        problem = None
        if status >= 500 and status in documented:  # the operation's own answer and body
            pass
        elif status >= 500:
            self.server_errors += 1
            problem = "5xx"
        elif status >= 400 and not _is_envelope(body):
            self.bad_envelopes += 1
            problem = "not an OpenAI error envelope"
        if problem and len(self.failures) < 10:
            if isinstance(case, str):
                sent = case
            else:
                body_text = json.dumps(case.body, default=str)[:300] if case.body else ""
                sent = f"{case.method} {case.formatted_path} {body_text}"
            self.failures.append(f"{problem}: {sent} -> {status} {body[:300]!r}")


def _is_envelope(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == ENVELOPE_KEYS


def _cheap(case: Case) -> Case:
    """Clamp the fields that decide how long a valid request generates."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = min(body[key], MAX_FUZZ_TOKENS)
        if "messages" in body and body.get("max_tokens") is None \
                and body.get("max_completion_tokens") is None:
            body["max_completion_tokens"] = MAX_FUZZ_TOKENS
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
            body["n"] = min(body["n"], MAX_FUZZ_N)
    return case


def oversized_bodies(body: dict[str, Any], fields: list[str]) -> Iterator[tuple[str, bytes]]:
    """(description, raw JSON) for `body` with each of `fields` (the schema's top-level
    properties), and each key of an object field, replaced by every oversized value in turn."""
    for name in dict.fromkeys([*body, *fields]):
        for raw in OVERSIZED_VALUES:
            yield f"{name}={raw[:12]}…", _with_raw({**body, name: _HOLE}, raw)
        value = body.get(name)
        if isinstance(value, dict) and value:
            yield f"{name} key of 5,000 digits", _with_raw(
                {**body, name: {**value, _HOLE: next(iter(value.values()))}}, f'"{HUGE_DIGITS}"')


def _body_fields(schema: dict[str, Any], path: str) -> list[str]:
    """The top-level properties of a POST operation's JSON body (inline, as prefixserve's
    schema writes them)."""
    body = schema["paths"][path]["post"].get("requestBody", {})
    return list(body.get("content", {}).get("application/json", {}).get("schema", {})
                .get("properties", {}))


def _documented(schema: dict[str, Any], path: str, method: str) -> frozenset[int]:
    """The statuses an operation's schema lists."""
    responses = schema["paths"][path][method.lower()].get("responses", {})
    return frozenset(int(code) for code in responses if code.isdigit())


def _with_raw(body: dict[str, Any], raw: str) -> bytes:
    return json.dumps(body).replace(json.dumps(_HOLE), raw).encode()


def fuzz(base_url: str, *, max_examples: int = 50, time_limit_s: float = 60.0,
         headers: dict[str, str] | None = None, seed: int | None = 0) -> FuzzReport:
    """Up to `max_examples` cases per operation and generation mode, within `time_limit_s`,
    then the oversized numbers in the first body each operation accepted."""
    raw_schema = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=30
                           ).raise_for_status().json()
    schema = schemathesis.openapi.from_dict(raw_schema)
    report = FuzzReport()
    stop_at = time.monotonic() + time_limit_s
    accepted: dict[str, dict[str, Any]] = {}  # path -> the first body answered 2xx
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            @settings(max_examples=max_examples, deadline=None, database=None,
                      phases=[Phase.generate],
                      verbosity=Verbosity.quiet,
                      suppress_health_check=list(HealthCheck))
            @given(operation.as_strategy(generation_mode=mode).map(_cheap))
            def run(case: Case) -> None:
                if time.monotonic() > stop_at:
                    return
                response = case.call(base_url=base_url, headers=headers, timeout=60)
                report.record(case, response.status_code, response.content,
                              _documented(raw_schema, case.path, case.method))
                if response.status_code < 300 and isinstance(case.body, dict):
                    accepted.setdefault(case.formatted_path, case.body)

            if seed is not None:
                run = fix_seed(seed)(run)
            with suppress(Unsatisfiable):  # nothing to make invalid (e.g. negative GET /health)
                run()
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        for path, body in accepted.items():
            for what, raw in oversized_bodies(body, _body_fields(raw_schema, path)):
                response = client.post(path, content=raw,
                                       headers={"content-type": "application/json"})
                report.record(f"POST {path} {what}", response.status_code, response.content)
                report.oversized += 1
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-examples", type=int, default=500,
                        help="cases per operation and mode (positive, negative)")
    parser.add_argument("--time-limit-s", type=float, default=1800.0)
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer`")
    parser.add_argument("--seed", type=int, default=None, help="reproducible run (default: random)")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    start = time.monotonic()
    report = fuzz(args.base_url, max_examples=args.max_examples,
                  time_limit_s=args.time_limit_s, headers=headers, seed=args.seed)
    statuses = dict(sorted(report.statuses.items()))
    print(f"cases: {report.cases} ({report.oversized} oversized)  5xx: {report.server_errors}  "
          f"non-envelope 4xx: {report.bad_envelopes}  statuses: {statuses}  "
          f"({time.monotonic() - start:.0f} s)")
    for failure in report.failures:
        print("  " + failure)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
