"""No function in the project reads a name that no scope defines.

Benchmarks and GPU-only paths do not run in CI, so a name left behind by a refactor (a NameError at the
first GPU run, as in benchmarks/kernels.py's sparse_attn after b96312f) would otherwise pass every test.
Python's own symbol tables decide what is local, enclosing or global; a global read must then be bound at
module level (assigned, imported, a def or class) or be a builtin.
"""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "serve_app", "benchmarks", "tests")
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__path__", "__package__"}


def unbound_globals(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(scope, line, name) for each global name a function or class reads that the module never binds."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins)) | MODULE_NAMES
    found: list[tuple[str, int, str]] = []

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if s.is_referenced() and s.is_global() and not s.is_declared_global() and s.get_name() not in known:
                found.append((table.get_name(), table.get_lineno(), s.get_name()))
        for child in table.get_children():
            walk(child)

    for child in top.get_children():
        walk(child)
    return found


def test_the_check_finds_a_missing_name_and_accepts_closures():
    source = (
        "import math\n"
        "LIMIT = 3\n"
        "def bench(m):\n"
        "    pools = [m] * LIMIT\n"
        "    run = lambda i: pools[i] + math.pi\n"  # a closure over a local deleted below: fine
        "    del pools\n"
        "    return run, m * swa_rec\n"  # bound nowhere: the bug class
        "class Box:\n"
        "    size = LIMIT\n"
        "    def area(self):\n"
        "        return self.size * undefined_height\n"
    )
    assert unbound_globals(source, "example.py") == [("bench", 3, "swa_rec"), ("area", 10, "undefined_height")]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_global_read_is_bound(package):
    missing = [f"{path.relative_to(ROOT)}: {scope} (line {line}) reads {name!r}"
               for path in sorted((ROOT / package).rglob("*.py"))
               for scope, line, name in unbound_globals(path.read_text(), str(path))]
    assert not missing, "names no scope defines:\n" + "\n".join(missing)
