"""`pip install .` puts one package at the top of site-packages, `prefixserve`, and two console
scripts: the repository's folders (router/, workers/, cluster/, bench/) install under it, with the
index's Lua scripts. Built and installed for real, into a fresh venv (no dependencies: only what
the wheel itself lays down is looked at)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True,
                   cwd=out)
    (path,) = out.glob("prefixserve-*.whl")
    return path


def dist_info(wheel: Path) -> str:
    name, version = wheel.name.split("-")[:2]
    return f"{name}-{version}.dist-info"


def test_the_wheel_holds_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/", 1)[0] for name in names} == {"prefixserve", dist_info(wheel)}
    for module in ("router/blocks.py", "workers/engine.py", "cluster/app.py", "bench/cli.py",
                   "router/lua/lookup.lua", "workers/models/llama.py",
                   "workers/kernels/csrc/paged_decode.cpp"):
        assert f"prefixserve/{module}" in names, module
    assert "prefixserve/__init__.py" not in names  # a namespace package
    # every module of the four folders, subpackages too (a package left out of pyproject's
    # list would work in an editable install and be missing from the wheel)
    for folder in ("router", "workers", "cluster", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            assert f"prefixserve/{path.relative_to(ROOT)}" in names, path
    for path in (ROOT / "workers/kernels/csrc").glob("*.[ch]*"):  # every kernel source, header
        assert f"prefixserve/{path.relative_to(ROOT)}" in names, path
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "prefixserve = prefixserve.cluster.cli:main" in entry_points
    assert "prefixserve-bench = prefixserve.bench.cli:main" in entry_points


def test_installed_into_a_fresh_venv_only_prefixserve_is_at_the_top(wheel: Path,
                                                                    tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    (site,) = venv.glob("lib/python*/site-packages")
    assert {p.name for p in site.iterdir()} == {"prefixserve", dist_info(wheel)}
    assert {"prefixserve", "prefixserve-bench"} <= {p.name for p in (venv / "bin").iterdir()}
    # the installed copy answers, from the venv and not from this checkout
    code = ("import importlib.resources as r, importlib.util as u;"
            "print(u.find_spec('prefixserve.router.blocks').origin);"
            "print((r.files('prefixserve.router.lua') / 'lookup.lua').is_file())")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.split()
    assert out == [str(site / "prefixserve" / "router" / "blocks.py"), "True"]
