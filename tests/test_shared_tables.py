"""The Engram tables in one node-wide shared mapping (engine/shared_tables.py): every opener maps the same file
holding the checkpoint's bytes (the oracle: the tensors load_checkpoint reads), the last user to release it
unlinks it, a killed user's file is reused by the next opener of its key and swept by openers of other keys, and
a directory too small is an error naming the sizes. The files go to a test folder, not /dev/shm."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.checkpoint.loader import load_checkpoint
from engine.config import load_config
from engine.shared_tables import PREFIX, SharedTables, SharedTablesError, TableSpec, backing_file, file_layout

ROOT = Path(__file__).resolve().parents[1]


def engram_specs(ckpt: Path) -> tuple[dict[str, TableSpec], dict[str, torch.Tensor]]:
    """The checkpoint's Engram tables as load_checkpoint reads them, and their specs."""
    weights = load_checkpoint(ckpt, load_config(ckpt), include_mtp=False, progress=False)
    tables = {n: t for n, t in weights.items() if ".engram.embed." in n}
    assert len(tables) == 4, sorted(tables)  # two Engram layers: rows and scales
    return {n: TableSpec(t.dtype, tuple(t.shape)) for n, t in tables.items()}, tables


def data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(PREFIX) and p.suffix not in (".lock", ".tmp"))


def test_two_opens_map_one_file_holding_the_checkpoint_bytes(tiny_checkpoint, tmp_path):
    specs, want = engram_specs(tiny_checkpoint)
    a = SharedTables.open(tiny_checkpoint, specs, tmp_path)
    b = SharedTables.open(tiny_checkpoint, specs, tmp_path)
    [data] = data_files(tmp_path)
    assert a.path == b.path == data and data.stat().st_size == file_layout(specs)[1] == a.nbytes
    inode = data.stat().st_ino
    for name, t in want.items():
        for tables in (a, b):
            got = tables.tensors[name]
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
            assert backing_file(got.data_ptr()) == (str(data), inode), name  # the kernel's view of the pages
    assert a.tensors[next(iter(want))].data_ptr() != b.tensors[next(iter(want))].data_ptr()  # two mappings...
    a.release()
    assert data.exists(), "released while b still maps it"  # ...of one file
    a.release()  # idempotent
    b.release()
    assert not any(tmp_path.iterdir()), sorted(tmp_path.iterdir())
    assert torch.equal(b.tensors[next(iter(want))].view(torch.uint8), want[next(iter(want))].view(torch.uint8))


def test_a_killed_users_file_is_reused_by_its_key_and_swept_by_others(tiny_checkpoint, tmp_path):
    specs, want = engram_specs(tiny_checkpoint)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from engine.shared_tables import SharedTables, TableSpec
        specs = {{n: TableSpec(getattr(torch, d), s) for n, (d, s) in {
            {n: (str(s.dtype).removeprefix('torch.'), s.shape) for n, s in specs.items()}!r}.items()}}
        tables = SharedTables.open({str(tiny_checkpoint)!r}, specs, __import__('pathlib').Path({str(tmp_path)!r}))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    [left] = data_files(tmp_path)
    inode = left.stat().st_ino
    other, held = tmp_path / f"{PREFIX}{'0' * 16}", tmp_path / f"{PREFIX}{'1' * 16}"  # orphaned / in use elsewhere
    for name in (other, held):
        name.write_bytes(b"x" * 10)
        name.with_name(name.name + ".lock").touch()
    other.with_name(other.name + ".123.tmp").touch()
    hold = os.open(held, os.O_RDONLY)
    fcntl.flock(hold, fcntl.LOCK_SH)
    try:
        tables = SharedTables.open(tiny_checkpoint, specs, tmp_path)
        assert tables.path == left and tables.path.stat().st_ino == inode, "the killed user's copy is reused"
        name = next(iter(want))
        assert torch.equal(tables.tensors[name].view(torch.uint8), want[name].view(torch.uint8))
        assert not other.exists() and not other.with_name(other.name + ".lock").exists()
        assert not other.with_name(other.name + ".123.tmp").exists()
        assert held.exists(), "a file another process maps was swept"
        tables.release()
        assert data_files(tmp_path) == [held]
    finally:
        os.close(hold)


def test_a_directory_too_small_is_an_error_naming_the_sizes(tiny_checkpoint, tmp_path, monkeypatch):
    specs, _ = engram_specs(tiny_checkpoint)

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SharedTablesError, match=rf"{file_layout(specs)[1]} bytes needed, \d+ free.*shm-size"):
        SharedTables.open(tiny_checkpoint, specs, tmp_path)
    assert not data_files(tmp_path) and not list(tmp_path.glob("*.tmp")), sorted(tmp_path.iterdir())
