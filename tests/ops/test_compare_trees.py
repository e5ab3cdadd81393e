"""benchmarks/compare_trees.py: trees from git revisions, layer_decode's table parsed, interleaved runs, the summary."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks.compare_trees import parse_table, prepare, run, summary

# the head of a real benchmarks/layer_decode.py output (H200, 2026-11-30), with a failed capture line
LAYER_DECODE_OUTPUT = """\
# NVIDIA H200, 132 SMs, torch 2.11.0+cu130
op backends: fp8_linear=kernel, moe=kernel

| layer | kind | context | tokens | experts | graph us | eager us | golden us | bytes | roofline us | graph / roofline | TB/s |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 20 | full r1 | 8,192 | 1 | 6 | 266.8 | 2305.6 | nan | 294.7 MB | 68.8 | 3.88x | 1.10 |
| 21 | reuse r1 | 8,192 | 1 | 6 | 187.6 | 1360.4 | nan | 283.2 MB | 66.1 | 2.84x | 1.51 |
  layer 8: capture failed: RuntimeError: out of memory
| 21 | reuse r1 | 8,192 | 6 | 35 | 385.4 | 1442.7 | nan | 829.5 MB | 193.6 | 1.99x | 2.15 |

| other | table |
|---|---|
| 1 | 2 |
| 30 | full | 8,192 | 1 | 6 | 1.0 | 1 | 1 | 1 | 1 | 1 | 1 |
"""


def test_parse_table_reads_layer_decode_rows():
    assert parse_table(LAYER_DECODE_OUTPUT) == {
        ("20", "8,192", "1"): 266.8, ("21", "8,192", "1"): 187.6, ("21", "8,192", "6"): 385.4}
    assert parse_table("no table here\n| a | b |\n|---|---|\n| 1 | 2 |\n") == {}
    rows = parse_table(LAYER_DECODE_OUTPUT.replace("| 187.6 |", "| failed |"))
    assert ("21", "8,192", "1") not in rows and rows[("21", "8,192", "6")] == 385.4


def test_summary_lists_runs_and_median_change_against_the_first_tree():
    a, b = ("20", "8,192", "1"), ("21", "8,192", "1")
    text = summary({"main": [{a: 290.0, b: 206.0}, {a: 294.0, b: 208.0}],
                    "ring": [{a: 284.0, b: 199.0}, {a: 286.0}]})
    lines = text.splitlines()
    assert lines[0] == "| layer | context | tokens | main | ring |"
    # medians: main 292.0 / 207.0; ring 285.0 / 199.0
    assert lines[2] == "| 20 | 8,192 | 1 | 290.0 / 294.0 | 284.0 / 286.0 (-7.0) |"
    assert lines[3] == "| 21 | 8,192 | 1 | 206.0 / 208.0 | 199.0 (-8.0) |"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_prepare_writes_revisions_and_the_working_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "pkg" / "a.py").write_text("v = 1\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    (repo / "pkg" / "a.py").write_text("v = 2\n")
    _git(repo, "commit", "-qam", "two")
    (repo / "pkg" / "a.py").write_text("v = 3\n")  # uncommitted
    (repo / "untracked.py").write_text("")
    out = tmp_path / "trees"
    (out / "old" / "stale").mkdir(parents=True)  # replaced, not merged
    trees = prepare(out, {"old": "HEAD~1", "new": "HEAD", "wt": "WORKTREE"}, repo)
    assert [t.name for t in trees] == ["old", "new", "wt"]
    assert [(t / "pkg" / "a.py").read_text() for t in trees] == ["v = 1\n", "v = 2\n", "v = 3\n"]
    assert not (out / "old" / "stale").exists() and not (out / "wt" / "untracked.py").exists()


def test_run_interleaves_trees_with_each_first_on_the_path(tmp_path):
    # each tree's script prints a table whose value comes from the tree's own module (found through PYTHONPATH)
    script = textwrap.dedent("""\
        import sys
        from tree_value import VALUE
        print("| layer | context | tokens | graph us |")
        print("|---|---|---|---|")
        print(f"| 21 | 8,192 | {sys.argv[1]} | {VALUE} |")
        """)
    for name, value in (("a", 10.0), ("b", 12.5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.py").write_text(script)
        (tmp_path / name / "tree_value.py").write_text(f"VALUE = {value}\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "bench.py").write_text("raise SystemExit(3)\n")
    trees = [tmp_path / n for n in ("a", "b", "broken")]
    results = run(trees, rounds=2, script="bench.py", args=["6"], timeout=60)
    key = ("21", "8,192", "6")
    assert results == {"a": [{key: 10.0}, {key: 10.0}], "b": [{key: 12.5}, {key: 12.5}], "broken": [{}, {}]}
    assert summary(results).splitlines()[2] == "| 21 | 8,192 | 6 | 10.0 / 10.0 | 12.5 / 12.5 (+2.5) | - |"


def test_command_line_prepare(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "benchmarks/compare_trees.py", "prepare", "--out", str(tmp_path),
                           "head=HEAD"], cwd=repo, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == str(tmp_path / "head")
    committed = subprocess.run(["git", "show", "HEAD:README.md"], cwd=repo, capture_output=True, check=True).stdout
    assert (tmp_path / "head" / "README.md").read_bytes() == committed
