"""The ingress runs without torch: importing `cluster.api` in a fresh interpreter leaves torch
unimported. The import graph itself (layering, no cycles) is checked in test_layering.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_ingress_does_not_import_torch() -> None:
    code = "import sys, cluster.api; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
