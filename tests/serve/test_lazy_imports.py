"""What starting the server imports: the HTTP ingress and the plain-data modules it is built from import neither
torch nor Triton (style.md: "The HTTP ingress imports no torch"), nor Pillow (images are decoded in the replica), and with KV sharing off neither
serve_app.kv_transfer nor NIXL (its UCX libraries load with it). Each check runs in a fresh interpreter, since this
one may have imported anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KV_MODULES = {"serve_app.kv_transfer", "serve_app.kv_sharing"}
TORCH_FREE = ("serve_app.ingress", "serve_app.settings", "serve_app.protocol", "serve_app.records",
              "serve_app.streaming", "serve_app.image_parts")


def modules_after(code: str) -> set[str]:
    """Every module name in sys.modules after running `code` in a new interpreter."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def nixl_modules(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0].startswith("nixl")}  # nixl, nixl_cu13, ... (not ray's own)


def test_the_app_with_kv_sharing_off_imports_no_nixl():
    modules = modules_after(
        "from serve_app.app import build_app\n"
        "from serve_app.settings import ServeSettings\n"
        "import serve_app.engine_replica, serve_app.ingress\n"
        "build_app(ServeSettings(checkpoint='/no/such/checkpoint', device='cpu'))")
    assert "serve_app.engine_replica" in modules and "serve_app.ingress" in modules
    assert not nixl_modules(modules) and not modules & KV_MODULES, sorted(nixl_modules(modules) | modules & KV_MODULES)


def test_kv_sharing_imports_nixl():
    """The other side of the check above: the module KV sharing needs does bring NIXL in."""
    assert "nixl_cu13" in nixl_modules(modules_after("import serve_app.kv_sharing"))


def heavy_modules(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in ("torch", "triton", "PIL")}


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_ingress_imports_no_torch_or_triton(module):
    modules = modules_after(f"import {module}")
    assert module in modules
    assert not heavy_modules(modules), f"{module} loads {sorted(heavy_modules(modules))[:5]}"


def test_the_torch_check_can_fail():
    """The other side: the engine itself does bring torch and Triton in, and the replica's image decoding Pillow."""
    assert {"torch", "triton"} <= heavy_modules(modules_after("import engine.core.engine"))
    assert "PIL" in heavy_modules(modules_after("import engine.vision.image_processing"))
