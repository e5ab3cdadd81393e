"""No module imports another module's private `_names`: what several modules share is public (style.md, "Shared
helpers are public"; engine/kernels/triton_common.py and tests/kernels/numeric.py are the shared homes).

Every module under engine/, serve_app/, benchmarks/ and tests/ is parsed (imports inside functions too); an
`from X import _name` fails when X is a project module: a package of the project, a relative import, or a script
beside the importer (benchmarks import `bench_serving` that way). Importing a public name under a private alias
(`import cdiv as _cdiv`) is fine, and so are dunders. There are no exceptions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "serve_app", "benchmarks", "tests")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_project_module(node: ast.ImportFrom, path: Path) -> bool:
    if node.level:
        return True
    first = (node.module or "").split(".")[0]
    folder = (ROOT / path).parent
    return first in PACKAGES or (folder / f"{first}.py").is_file() or (folder / first).is_dir()


def private_imports(source: str, path: Path) -> list[str]:
    """'file:line: from X import _name' for each private name `source` imports from a project module."""
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ImportFrom) and is_project_module(node, path):
            module = "." * node.level + (node.module or "")
            found += [f"{path}:{node.lineno}: from {module} import {a.name}" for a in node.names if is_private(a.name)]
    return found


def project_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_module_imports_another_modules_private_names():
    assert len(project_files()) > 100, "the walk found too few modules"
    found = [hit for p in project_files()
             for hit in private_imports(p.read_text(encoding="utf-8"), p.relative_to(ROOT))]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


PLANTED = '''
from engine.kernels.gemv_shapes import cdiv as _cdiv
from engine.quant import BLOCK, __doc__
from torch.nn import _reduction
from engine.kernels.fp8_linear import MAX_TICKETS, _bf16_bits


def f():
    from serve_app.kv_transfer import _coalesce
    from .conftest import _helper
    from bench_serving import _percentile
'''


@pytest.mark.parametrize("where", [Path("benchmarks/planted.py"), Path("tests/planted.py")])
def test_the_check_finds_planted_private_imports(where):
    """A planted module: the private names of project modules are found (also inside a function, relative and
    script-sibling imports); a public name under a private alias, a dunder and a third-party private are not."""
    hits = private_imports(PLANTED, where)
    names = [h.rsplit(" ", 1)[-1] for h in hits]
    expected = ["_bf16_bits", "_coalesce", "_helper"] + (["_percentile"] if where.parent.name == "benchmarks" else [])
    assert sorted(names) == sorted(expected), hits
    assert any(h.startswith(f"{where}:5: from engine.kernels.fp8_linear") for h in hits), hits
