"""docs/operations.md: every command says whether it was run here or needs a cluster, and every repository
path it names exists."""

from __future__ import annotations

import re

from .ops_files import OPERATIONS_DOC, REPO

MARKERS = ("# ran here", "# needs a cluster")


def command_lines(text: str) -> list[str]:
    """Non-empty lines inside ```bash fences."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash" if not inside else False
            continue
        if inside and line.strip():
            out.append(line)
    return out


def test_every_command_is_marked():
    lines = command_lines(OPERATIONS_DOC.read_text())
    assert len(lines) >= 20
    unmarked = [line for line in lines if not any(m in line for m in MARKERS)]
    assert unmarked == []


def test_named_repository_paths_exist():
    text = OPERATIONS_DOC.read_text()
    paths = set(re.findall(r"`((?:k8s|tests/ops|serve_app|engine|docs)/[\w./-]*\w|[\w-]+\.yaml)`", text))
    assert "k8s/rayservice.yaml" in paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == []
