"""Compare versions of the code on one device, interleaved: the method of benchmarks/RESULTS.md's kernel passes.

Runs of the same code differ by a few percent between device calls (and up to ~25 us per layer at T = 6), so a
change is judged against the code it replaces in the same call, round by round. Two steps:

    # here (a git checkout): each NAME=REV becomes a tree under OUT (`git archive`; WORKTREE = the working tree's
    # tracked files as they are now, uncommitted edits included)
    python benchmarks/compare_trees.py prepare --out .gpu_carry/trees main=HEAD ring=gemv-ring
    # on the GPU machine (OUT carried there): build each tree's CUDA libraries, then run the benchmark in every
    # tree per round and print one table of graph us per (layer, context, tokens) and tree
    python benchmarks/compare_trees.py run --trees .gpu_carry/trees --rounds 2 -- --contexts 8192 --tokens 1,6

`run` starts `python3 benchmarks/layer_decode.py --no-golden ARGS` in each tree (`--script` picks another script
that prints layer_decode's table), with the tree first on PYTHONPATH (what PYTHONPATH held stays behind it, e.g.
a carried tokenizer). The table: each tree's runs, and the change of its median against the first tree's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KEY_COLUMNS = ("layer", "context", "tokens")
VALUE_COLUMN = "graph us"
CUDA_LIBRARIES = ("fp8_gemv", "bf16_gemv", "moe_fp4", "sparse_decode", "indexer_scan", "hc_mixes")

Key = tuple[str, str, str]


def prepare(out: Path, revisions: dict[str, str], repo: Path = Path(".")) -> list[Path]:
    """Write each revision's tracked files to out/NAME (replacing what was there); returns the trees."""
    trees = []
    for name, rev in revisions.items():
        tree = out / name
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        if rev == "WORKTREE":
            files = subprocess.run(["git", "ls-files", "-z"], cwd=repo, check=True, capture_output=True).stdout
            for rel in filter(None, files.decode().split("\0")):
                src, dst = repo / rel, tree / rel
                if src.is_file():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(src.read_bytes())
        else:
            with tempfile.TemporaryFile() as tar:
                subprocess.run(["git", "archive", rev], cwd=repo, check=True, stdout=tar)
                tar.seek(0)
                with tarfile.open(fileobj=tar) as archive:
                    archive.extractall(tree, filter="data")
        trees.append(tree)
    return trees


def parse_table(text: str) -> dict[Key, float]:
    """The rows of a markdown table with KEY_COLUMNS and VALUE_COLUMN in its header (layer_decode.py's):
    (layer, context, tokens) -> graph us. Rows whose value is not a number, and other tables, are left out."""
    rows: dict[Key, float] = {}
    columns: list[str] | None = None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue  # other lines (a layer's failed capture) may sit inside the table
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(k in cells for k in (*KEY_COLUMNS, VALUE_COLUMN)):
            columns = cells
        elif set("".join(cells)) <= set("-: "):
            continue  # the separator row
        elif columns is None or len(cells) != len(columns):
            columns = None  # another table
        else:
            row = dict(zip(columns, cells))
            try:
                rows[tuple(row[k] for k in KEY_COLUMNS)] = float(row[VALUE_COLUMN])
            except ValueError:
                continue
    return rows


def summary(results: dict[str, list[dict[Key, float]]]) -> str:
    """One markdown table: per key, each tree's runs ("a / b") and its median's change against the first tree."""
    names = list(results)
    keys = list(dict.fromkeys(k for runs in results.values() for run in runs for k in run))
    lines = ["| layer | context | tokens | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    for key in keys:
        base = _median(results[names[0]], key)
        cells = []
        for name in names:
            runs = [run[key] for run in results[name] if key in run]
            cell = " / ".join(f"{v:.1f}" for v in runs) or "-"
            med = _median(results[name], key)
            if name != names[0] and base is not None and med is not None:
                cell += f" ({med - base:+.1f})"
            cells.append(cell)
        lines.append(f"| {' | '.join(key)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(runs: list[dict[Key, float]], key: Key) -> float | None:
    values = [run[key] for run in runs if key in run]
    return statistics.median(values) if values else None


def build(tree: Path, libraries: tuple[str, ...] = CUDA_LIBRARIES) -> None:
    """Compile the tree's CUDA libraries (cached by source hash, so trees with the same sources share them)."""
    code = ("from concurrent.futures import ThreadPoolExecutor as P; from engine.kernels import cuda_build as c; "
            f"list(P(6).map(c.build, {libraries!r}))")
    subprocess.run([sys.executable, "-c", code], cwd=tree, env=_env(tree), check=True)


def run(trees: list[Path], rounds: int, script: str, args: list[str], timeout: float
        ) -> dict[str, list[dict[Key, float]]]:
    """Every tree's script once per round, in order; its table parsed (an empty run where it failed)."""
    results: dict[str, list[dict[Key, float]]] = {tree.name: [] for tree in trees}
    for r in range(rounds):
        for tree in trees:
            proc = subprocess.run([sys.executable, script, *args], cwd=tree, env=_env(tree), capture_output=True,
                                  text=True, timeout=timeout)
            rows = parse_table(proc.stdout)
            if proc.returncode != 0 or not rows:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
                print(f"round {r + 1}, {tree.name}: exit {proc.returncode}, {len(rows)} rows: {tail}", flush=True)
            results[tree.name].append(rows)
    return results


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree.resolve()), env.get("PYTHONPATH")) if p)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="write each NAME=REV as a tree under --out")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("revisions", nargs="+", help="NAME=REV (a git revision, or WORKTREE)")
    r = sub.add_parser("run", help="build and benchmark every tree under --trees, interleaved")
    r.add_argument("--trees", type=Path, required=True)
    r.add_argument("--names", help="comma-separated trees in order (default: every folder, sorted)")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--script", default="benchmarks/layer_decode.py")
    r.add_argument("--timeout", type=float, default=300)
    r.add_argument("--no-build", action="store_true")
    r.add_argument("args", nargs=argparse.REMAINDER, help="after --: the script's arguments")
    a = parser.parse_args()
    if a.step == "prepare":
        pairs = dict(v.split("=", 1) for v in a.revisions)
        for tree in prepare(a.out, pairs):
            print(tree)
        return
    names = a.names.split(",") if a.names else sorted(d.name for d in a.trees.iterdir() if d.is_dir())
    trees = [a.trees / n for n in names]
    if not a.no_build:
        with ThreadPoolExecutor(len(trees)) as pool:
            list(pool.map(build, trees))
    args = [v for v in a.args if v != "--"]
    if a.script == "benchmarks/layer_decode.py" and "--no-golden" not in args:
        args.append("--no-golden")
    print(summary(run(trees, a.rounds, a.script, args, a.timeout)))


if __name__ == "__main__":
    main()
