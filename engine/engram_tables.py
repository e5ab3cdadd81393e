"""Engram's static tables (compressed token map, bucket primes, offsets, hash multipliers) and the
per-position n-gram hash (spec section 4.3; reference `inference/engram.py`).

Everything here must match training bit-exactly: the hash ids index a ~384M-row table per layer.
Hash columns of one layer are ordered (order 2: heads 0..H-1, order 3: heads 0..H-1, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
from tokenizers import Regex, normalizers

from engine.tokenizer import Tokenizer

DEAD = -1  # compressed id of a token that takes no part in any n-gram (image spans)
INT64_MAX = int(np.iinfo(np.int64).max)
LAYER_SEED_PRIME = 10007
TOKEN_MAP_CACHE_PREFIX = "engram_token_map"
USER_CACHE_DIR = Path.home() / ".cache" / "dsv41-serve"

# ---------------------------------------------------------------------------------------------
# Compressed token map
# ---------------------------------------------------------------------------------------------


def _token_normalizer() -> normalizers.Normalizer:
    # U+E000 (private use) stands in for a token that is exactly one space, so Strip() keeps it
    # instead of collapsing it to "" and merging it with unrelated tokens.
    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def compute_compressed_token_map(backend: tokenizers.Tokenizer) -> tuple[np.ndarray, int]:
    """The reference map, uncached. `backend` is a raw `tokenizers.Tokenizer`.

    Each id is decoded alone; ids whose text normalises alike share a compressed id, and new
    compressed ids are handed out in order of first appearance. Returns (int64 [vocab], count).
    """
    normalizer = _token_normalizer()
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    key_to_new: dict[str, int] = {}
    token_map = np.empty(vocab_size, dtype=np.int64)
    for token_id in range(vocab_size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte token: key it by its raw form
            key = backend.id_to_token(token_id)
        else:
            normalized = normalizer.normalize_str(text)
            key = normalized if normalized else text
        token_map[token_id] = key_to_new.setdefault(key, len(key_to_new))
    return token_map, len(key_to_new)


def _check_token_map(token_map: np.ndarray, source: Path) -> int:
    """Validate a map read from disk; returns its compressed vocab size."""
    if token_map.ndim != 1 or token_map.dtype != np.int64 or token_map.size == 0:
        raise ValueError(f"{source}: not a 1-D int64 token map ({token_map.dtype}, {token_map.shape})")
    # first-appearance numbering: each id is at most one above every id before it
    previous_max = np.maximum.accumulate(np.concatenate([[-1], token_map[:-1]]))
    if token_map[0] != 0 or np.any(token_map > previous_max + 1) or np.any(token_map < 0):
        raise ValueError(f"{source}: not a first-appearance token map; delete it to rebuild")
    return int(token_map.max()) + 1


def _save_atomic(path: Path, token_map: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, token_map, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def token_map_cache_name(tokenizer_json: bytes) -> str:
    """`engram_token_map.<first 16 hex of sha256(tokenizer.json bytes)>.npy`."""
    return f"{TOKEN_MAP_CACHE_PREFIX}.{hashlib.sha256(tokenizer_json).hexdigest()[:16]}.npy"


def build_compressed_token_map(
    tokenizer: Path | str | Tokenizer, cache_dir: Path | None = None
) -> tuple[np.ndarray, int]:
    """Token id -> compressed id (int64 [vocab]) and the compressed vocab size, cached on disk.

    `tokenizer` is a `tokenizer.json` path or a loaded `Tokenizer`. The cache file
    (`token_map_cache_name`) is looked for next to the tokenizer file, then in `cache_dir`
    (default `~/.cache/dsv41-serve`); a fresh build is written to the first of them that is
    writable. Keyed by the file's bytes, so an edited tokenizer never reuses a stale map.
    """
    tok_path = tokenizer.path if isinstance(tokenizer, Tokenizer) else Path(tokenizer)
    if not tok_path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {tok_path}")
    name = token_map_cache_name(tok_path.read_bytes())
    candidates = [tok_path.parent / name, Path(cache_dir or USER_CACHE_DIR) / name]
    for path in candidates:
        if path.is_file():
            token_map = np.load(path, allow_pickle=False)
            num_compressed = _check_token_map(token_map, path)
            if isinstance(tokenizer, Tokenizer) and token_map.size != tokenizer.vocab_size:
                raise ValueError(f"{path}: {token_map.size} entries for a vocab of {tokenizer.vocab_size}")
            return token_map, num_compressed

    if isinstance(tokenizer, Tokenizer):
        backend = tokenizer.backend
    else:
        backend = tokenizers.Tokenizer.from_file(str(tok_path))
    token_map, num_compressed = compute_compressed_token_map(backend)
    errors = []
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _save_atomic(path, token_map)
            break
        except OSError as e:  # read-only checkpoint folder: fall through to the user cache
            errors.append(f"{path}: {e}")
    else:
        warnings.warn(f"Engram token map not cached ({'; '.join(errors)})", RuntimeWarning, stacklevel=2)
    return token_map, num_compressed


# ---------------------------------------------------------------------------------------------
# Primes, offsets, multipliers
# ---------------------------------------------------------------------------------------------


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n < 3.3e24)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    engram_layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size_start: int
) -> list[list[int]]:
    """Bucket moduli per engram layer, flat in column order ((max_ngram_size-1)*n_heads each).

    Each (order, head) gets the smallest prime above the previous one (the search restarting at
    `vocab_size_start - 1` for every order) that no earlier column of any layer has taken.
    """
    seen: set[int] = set()
    primes = []
    for _ in engram_layer_ids:
        layer = []
        for _ in range(max_ngram_size - 1):
            current = vocab_size_start - 1
            for _ in range(n_heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                layer.append(current)
        primes.append(layer)
    return primes


def engram_offsets(primes_of_layer: Sequence[int]) -> list[int]:
    """First table row of each column: the exclusive cumulative sum of the layer's primes."""
    offsets, total = [], 0
    for p in primes_of_layer:
        offsets.append(total)
        total += p
    return offsets


def engram_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> np.ndarray:
    """Odd int64 multipliers [max_ngram_size] of one layer, < int64_max // compressed_vocab_size."""
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    rng = np.random.default_rng(LAYER_SEED_PRIME * layer_id)
    return rng.integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1


@dataclass(frozen=True)
class EngramTables:
    """The static hashing state of every engram layer (row l of each tensor is engram_layer_ids[l])."""

    token_map: torch.Tensor  # [vocab] int64, token id -> compressed id
    num_compressed: int
    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: torch.Tensor  # [n_layers, n_hash_cols] int64
    offsets: torch.Tensor  # [n_layers, n_hash_cols] int64
    multipliers: torch.Tensor  # [n_layers, max_ngram_size] int64
    pad_id: int  # compressed id of the engram pad token

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Table rows per layer (config `engram_num_embeddings`)."""
        return tuple(int(x) for x in self.primes.sum(dim=1))

    def to(self, device: torch.device | str) -> EngramTables:
        return dataclasses.replace(
            self,
            token_map=self.token_map.to(device),
            primes=self.primes.to(device),
            offsets=self.offsets.to(device),
            multipliers=self.multipliers.to(device),
        )

    @classmethod
    def build(
        cls,
        token_map: np.ndarray | torch.Tensor,
        num_compressed: int,
        engram_layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        vocab_size_start: int,
        pad_token_id: int,
    ) -> EngramTables:
        token_map = torch.as_tensor(token_map, dtype=torch.int64).cpu()
        assert token_map.ndim == 1 and 0 <= int(token_map.min()) and int(token_map.max()) < num_compressed
        assert max_ngram_size >= 2 and n_heads >= 1
        primes = engram_primes(engram_layer_ids, max_ngram_size, n_heads, vocab_size_start)
        multipliers = np.stack([engram_multipliers(i, num_compressed, max_ngram_size) for i in engram_layer_ids])
        # No int64 overflow: compressed id <= num_compressed - 1 and multiplier < int64_max //
        # num_compressed, so every product is < int64_max; XOR of non-negatives stays below
        # 2^63, so `%` sees non-negative operands and the hash is the same as with Python ints.
        assert (num_compressed - 1) * int(multipliers.max()) <= INT64_MAX
        return cls(
            token_map=token_map,
            num_compressed=num_compressed,
            layer_ids=tuple(engram_layer_ids),
            max_ngram_size=max_ngram_size,
            n_heads=n_heads,
            primes=torch.tensor(primes, dtype=torch.int64),
            offsets=torch.tensor([engram_offsets(p) for p in primes], dtype=torch.int64),
            multipliers=torch.from_numpy(multipliers),
            pad_id=int(token_map[pad_token_id]),
        )


# ---------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------


def compress_token_ids(
    tables: EngramTables, token_ids: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """token ids [B, S] -> compressed ids [B, S], DEAD where `token_mask` is False."""
    compressed = tables.token_map[token_ids]
    if token_mask is not None:
        compressed = torch.where(token_mask, compressed, DEAD)
    return compressed


def initial_history(tables: EngramTables, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """History [B, max_ngram_size-1] for requests at position 0 (its values are never read there)."""
    return torch.full((batch_size, tables.max_ngram_size - 1), tables.pad_id, dtype=torch.int64, device=device)


def next_history(
    tables: EngramTables, history: torch.Tensor, token_ids: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """History after `token_ids` [B, S]: the compressed ids (DEAD if masked) of the last max_ngram_size-1 tokens."""
    window = torch.cat([history, compress_token_ids(tables, token_ids, token_mask)], dim=1)
    return window[:, -(tables.max_ngram_size - 1) :]


def hash_ngrams(
    tables: EngramTables,
    token_ids: torch.Tensor,
    history: torch.Tensor,
    start_pos: int | torch.Tensor,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hash ids of the n-grams (orders 2..max_ngram_size) ending at each position.

    token_ids:  [B, S] int64 raw token ids at absolute positions start_pos .. start_pos+S-1.
    history:    [B, max_ngram_size-1] int64 compressed ids (DEAD allowed) of the tokens just
                before start_pos, oldest first (`initial_history` / `next_history`).
    start_pos:  int, or [B] int64 for rows at different positions.
    token_mask: [B, S] bool, False for tokens that take no part in an n-gram (image spans).
    Returns     [B, S, n_layers, n_hash_cols] int64 table rows, all >= 0.

    Look-back stops at position 0 and at a DEAD token; once blocked, that shift and every older
    one hashes as the pad id.
    """
    K = tables.max_ngram_size - 1
    B, S = token_ids.shape
    assert token_ids.dtype == torch.int64 and history.dtype == torch.int64
    assert history.shape == (B, K), f"history {tuple(history.shape)}, expected {(B, K)}"
    window = torch.cat([history, compress_token_ids(tables, token_ids, token_mask)], dim=1)  # [B, K+S]
    steps = torch.arange(S, device=token_ids.device)
    if isinstance(start_pos, torch.Tensor):
        positions = start_pos.to(token_ids.device).view(B, 1) + steps  # [B, S]
    else:
        positions = (start_pos + steps).expand(B, S)

    tokens, blocked = [], torch.zeros(B, S, dtype=torch.bool, device=token_ids.device)
    for shift in range(tables.max_ngram_size):
        source = window[:, K - shift : K - shift + S]  # [B, S] compressed id at position p - shift
        blocked = blocked | (positions < shift) | (source == DEAD)
        tokens.append(torch.where(blocked, tables.pad_id, source))
    tokens = torch.stack(tokens, dim=-1)  # [B, S, max_ngram_size]

    # After XOR-ing in shift n the running value hashes the (n+1)-gram; each order has its own
    # n_heads prime moduli and its own disjoint row ranges.
    products = tokens.unsqueeze(2) * tables.multipliers  # [B, S, n_layers, max_ngram_size]
    rolling, hashes = products[..., 0], []
    H = tables.n_heads
    for n in range(1, tables.max_ngram_size):
        rolling = rolling ^ products[..., n]  # [B, S, n_layers]
        hashes.append(rolling.unsqueeze(-1) % tables.primes[:, (n - 1) * H : n * H])  # [B, S, n_layers, H]
    return torch.cat(hashes, dim=-1) + tables.offsets  # [B, S, n_layers, n_hash_cols]
