"""Bad input at the HTTP API: a short schemathesis fuzz from the API's own OpenAPI schema, and
hand-written hostile bodies. Never a 5xx; every error in OpenAI's envelope.

One module-scoped cluster (auth off, one worker, a short context so valid fuzz cases are cheap).
`python -m prefixserve.bench.load.fuzz_api` runs the long fuzz against any endpoint.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from servekit import replica_logs, serve_app

from prefixserve.bench.load.fuzz_api import fuzz
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.cluster

APP = "prefixserve-fuzz-test"
MAX_BODY = 256 * 1024
FUZZ_EXAMPLES = 30  # per operation and mode: ~150 cases in ~10 s
FUZZ_TIME_LIMIT_S = 40.0


@pytest.fixture(scope="module")
def base_url(redis_server: LocalRedis) -> Iterator[str]:
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME,
        redis_url=redis_server.url, num_workers=1, cpus_per_worker=0.5, cpus_per_ingress=0.25,
        num_blocks=64, max_model_len=128, max_num_seqs=32, max_request_bytes=MAX_BODY,
        access_log=False,
    )
    with serve_app(config, APP) as url:
        yield url


def test_schema_fuzz_never_5xx(base_url: str) -> None:
    report = fuzz(base_url, max_examples=FUZZ_EXAMPLES, time_limit_s=FUZZ_TIME_LIMIT_S)
    print(f"fuzz: {report.cases} cases, {report.server_errors} 5xx, statuses {report.statuses}")
    assert report.cases >= 50, report
    assert report.ok, "\n".join(report.failures)
    assert report.statuses.get(200) and report.statuses.get(400), report.statuses
    assert report.oversized >= 100, report  # every field of each body, as oversized numbers


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _j(body: object) -> bytes:
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        (CMPL, _j({"prompt": "x", "max_tokens": 10**12}), 400),
        (CMPL, _j({"prompt": "x", "max_tokens": 2**70}), 400),
        (CHAT, _j({"messages": USER, "max_completion_tokens": 2**64}), 400),
        (CMPL, _j({"prompt": "x", "n": 10**20}), 400),
        (CMPL, _j({"prompt": "x", "best_of": 10**9}), 400),
        (CMPL, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
        (CMPL, b'{"prompt": "x", "user": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}", 400),
        (CMPL, _j({"prompt": "x", "pad": "y" * (MAX_BODY + 1)}), 413),
        (CMPL, _j({"prompt": [[1, 2]] * 5000, "max_tokens": 1}), 400),
        (CMPL, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}', 400),
        (CMPL, b'{"prompt": "ok", "stop": ["\xc3\x28"]}', 400),
        (CMPL, _j({"prompt": [1, 2**64]}), 400),
        (CMPL, _j({"prompt": [1, 2**40]}), 400),
        (CMPL, _j({"prompt": [1.5, 2]}), 400),
        (CMPL, _j({"prompt": "x", "stop": [str(i) for i in range(100)]}), 400),
        (CMPL, _j({"prompt": "x", "stop_token_ids": list(range(100))}), 400),
        (CMPL, _j({"prompt": "x", "stop_token_ids": [2**70]}), 400),
        (CMPL, _j({"prompt": "x", "stop_token_ids": [10**6], "max_tokens": 1}), 400),
        (CHAT, _j({"messages": USER, "stop_token_ids": [3, 10**6]}), 400),
        (CMPL, _j({"prompt": "x", "stop_token_ids": [3], "max_tokens": 1}), 200),
        (CMPL, b'{"prompt": "x", "temperature": NaN}', 400),
        (CMPL, b'{"prompt": "x", "top_p": Infinity}', 400),
        (CMPL, _j({"prompt": "x", "temperature": 1e308 * 10}), 400),
        (CMPL, _j({"prompt": "x", "top_p": -0.5}), 400),
        (CMPL, _j({"prompt": "x", "top_k": -5}), 400),
        (CMPL, _j({"prompt": "x", "seed": 2**64}), 400),
        (CMPL, _j({"prompt": "x", "logprobs": -1}), 400),
        (CHAT, _j({"messages": USER, "logprobs": True, "top_logprobs": 99}), 400),
        (CHAT, _j({"messages": []}), 400),
        (CHAT, _j({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400),
        (CHAT, _j({"messages": [{"role": "user"}]}), 400),
        (CMPL, b"null", 400),
        (CMPL, b"[]", 400),
        (CMPL, b'"just a string"', 400),
        (CMPL, b"\x00\x01\x02", 400),
        # past Python's 4,300-digit int() limit: refused by length, not a 500
        (CMPL, _j({"prompt": "x", "logit_bias": {"9" * 5000: 1}}), 400),
        (CHAT, _j({"messages": USER, "logit_bias": {"1" * 5000: -1}}), 400),
        (CMPL, _j({"prompt": "x", "logit_bias": {"0" * 11: 1}}), 400),
        (CMPL, _j({"prompt": "x", "logit_bias": {"0" * 10: 1}, "max_tokens": 1}), 200),
    ],
)
def test_hostile_bodies(base_url: str, path: str, body: bytes, status: int) -> None:
    r = httpx.post(base_url + path, content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:500]
    if status >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"


def test_a_content_length_of_5000_digits_is_refused(base_url: str) -> None:
    url = httpx.URL(base_url)
    with socket.create_connection((url.host, url.port), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n{}")
        answer = conn.recv(65536)
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:300]


def test_wrong_method_and_path_are_enveloped(base_url: str) -> None:
    for r in (httpx.get(f"{base_url}/v1/completions"), httpx.post(f"{base_url}/v2/x", json={})):
        assert r.status_code in (404, 405)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_access_log_off_leaves_no_line_per_request(base_url: str) -> None:
    resp = httpx.post(f"{base_url}{CMPL}", json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200
    for deployment in ("OpenAIIngress", "LLMWorker"):
        log = replica_logs(APP, deployment)
        assert "Finished initializing replica" in log, deployment  # the right files
        assert "POST /v1/" not in log and "CALL generate" not in log, deployment
