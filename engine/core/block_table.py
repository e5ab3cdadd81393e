"""A device block table updated in place (issue 19: block tables updated incrementally).

The decode step reads each row's global block table from a table that lives on the device across steps. The host
keeps a mirror of what the device holds and stages only the entries that change: a decoding request appends a
block every global_block_size tokens, so a step of B requests at context C stages O(B) entries, not the B x C /
global_block_size of a full table (64 requests at 64K tokens: 65,536 entries, ~4.5 ms of host time a step to fill
from Python lists on the 2-core CI machine).

Invariant: after the updates of a step are applied in order, device row b equals the step's block list of row b
followed by -1 up to the table's width (what a table filled from scratch holds).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableMirror:
    """The host's copy of a device table int64 [rows, width] (flat index b * width + j)."""

    def __init__(self, rows: int, width: int):
        self.width = width
        self.rows: list[list[int]] = [[] for _ in range(rows)]

    @property
    def capacity(self) -> int:
        """The most entries one step can change (every row, its whole width)."""
        return len(self.rows) * self.width

    def reset(self) -> None:
        """The device table was filled with -1."""
        self.rows = [[] for _ in self.rows]

    def updates(self, tables: Sequence[list[int]], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows 0 .. num_rows - 1 become tables[b] (rows past len(tables): empty). Returns the int64 flat indices and
        values to write, and takes them as the device's new contents. A row that only grew or only shrank changes
        only its entries past the shorter list; any other change rewrites the row (and -1s what it no longer holds)."""
        assert len(tables) <= num_rows <= len(self.rows), f"{len(tables)} tables for {num_rows} of {len(self.rows)} rows"
        idx: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for b in range(num_rows):
            new, old = (tables[b] if b < len(tables) else []), self.rows[b]
            if new == old:
                continue
            assert len(new) <= self.width, f"row {b}: {len(new)} blocks, the table holds {self.width}"
            short, long = (old, new) if len(old) <= len(new) else (new, old)
            keep = len(short) if long[:len(short)] == short else 0
            end = max(len(new), len(old))
            row = np.full(end - keep, -1, dtype=np.int64)
            row[:len(new) - keep] = new[keep:]
            idx.append(np.arange(b * self.width + keep, b * self.width + end, dtype=np.int64))
            vals.append(row)
            self.rows[b] = list(new)
        if not idx:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        return np.concatenate(idx), np.concatenate(vals)
