import hashlib
import struct
from types import MappingProxyType

import pytest

from engine.core.prefix_hash import block_hashes, fingerprint

SALT = b"\x00" * 32
TOKENS = list(range(1000, 1000 + 4 * 64))  # four full blocks of 64


def test_deterministic_and_one_32_byte_hash_per_full_block():
    a = block_hashes(TOKENS, 64, SALT)
    b = block_hashes(list(TOKENS), 64, SALT)
    assert a == b
    assert len(a) == 4
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a)
    assert len(set(a)) == 4
    assert block_hashes(tuple(TOKENS), 64, SALT) == a


def test_different_salt_changes_every_hash():
    a = block_hashes(TOKENS, 64, SALT)
    b = block_hashes(TOKENS, 64, b"\x01" + SALT[1:])
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_trailing_partial_block_gets_no_hash():
    full = block_hashes(TOKENS[:128], 64, SALT)
    assert block_hashes(TOKENS[:130], 64, SALT) == full
    assert block_hashes(TOKENS[:191], 64, SALT) == full
    assert len(block_hashes(TOKENS[:127], 64, SALT)) == 1
    assert block_hashes(TOKENS[:63], 64, SALT) == []
    assert block_hashes([], 64, SALT) == []


def test_parent_extends_the_chain_incrementally():
    whole = block_hashes(TOKENS, 64, SALT)
    assert block_hashes(TOKENS[64:128], 64, SALT, parent=whole[0]) == whole[1:2]
    assert block_hashes(TOKENS[64:], 64, SALT, parent=whole[0]) == whole[1:]
    # Built one block at a time, as a decoding request fills its blocks.
    chain, parent = [], None
    for i in range(4):
        chain += block_hashes(TOKENS[i * 64 : (i + 1) * 64], 64, SALT, parent=parent)
        parent = chain[-1]
    assert chain == whole


@pytest.mark.parametrize("block_idx", [0, 1, 2, 3])
def test_changing_one_token_changes_its_block_and_all_later_ones(block_idx):
    before = block_hashes(TOKENS, 64, SALT)
    changed = list(TOKENS)
    changed[block_idx * 64 + 17] += 1
    after = block_hashes(changed, 64, SALT)
    assert after[:block_idx] == before[:block_idx]
    assert all(x != y for x, y in zip(after[block_idx:], before[block_idx:], strict=True))


def test_matches_a_hand_computed_sha256_chain():
    tokens = [1, 2, 3, -1, 7, 2**63 - 1, 0, 5, 9]  # two full blocks of 4, one partial token
    h0 = hashlib.sha256(SALT + struct.pack("<4q", 1, 2, 3, -1)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4q", 7, 2**63 - 1, 0, 5)).digest()
    assert block_hashes(tokens, 4, SALT) == [h0, h1]
    # Pinned so that a change of the byte format (which would split a fleet's caches) is noticed.
    assert h0.hex() == "28f3023c237ece0e74b2c01a02ce8d3a6d46a4cafc62376ae7a8d88536931f7d"


def test_block_size_must_be_positive():
    with pytest.raises(AssertionError):
        block_hashes(TOKENS, 0, SALT)


MODEL = {"dim": 8, "n_layers": 2, "moe": {"n_experts": 4, "topk": 2}}
LAYOUT = {"block_size": 64, "kv_dtype": "fp8"}


def test_fingerprint_is_sha256_of_canonical_json():
    fp = fingerprint({"dim": 8}, "w1", {"block_size": 64})
    text = b'{"layout":{"block_size":64},"model":{"dim":8},"weights":"w1"}'
    assert fp == hashlib.sha256(text).digest()
    assert fp.hex() == "665de647210fa8c0063c5c47ce28e3e54515f806b725ef72728c362aa21f5412"


def test_fingerprint_changes_with_each_input():
    base = fingerprint(MODEL, "sha256:abc", LAYOUT)
    assert len(base) == 32
    assert fingerprint({**MODEL, "dim": 16}, "sha256:abc", LAYOUT) != base
    assert fingerprint({**MODEL, "moe": {"n_experts": 4, "topk": 3}}, "sha256:abc", LAYOUT) != base
    assert fingerprint(MODEL, "sha256:abd", LAYOUT) != base
    assert fingerprint(MODEL, "sha256:abc", {**LAYOUT, "kv_dtype": "bf16"}) != base
    assert fingerprint(MODEL, "sha256:abc", {**LAYOUT, "extra": None}) != base


def test_fingerprint_ignores_key_order_and_mapping_type():
    base = fingerprint(MODEL, "sha256:abc", LAYOUT)
    reordered_model = {"moe": {"topk": 2, "n_experts": 4}, "n_layers": 2, "dim": 8}
    reordered_layout = {"kv_dtype": "fp8", "block_size": 64}
    assert fingerprint(reordered_model, "sha256:abc", reordered_layout) == base
    assert fingerprint(MappingProxyType(MODEL), "sha256:abc", MappingProxyType(LAYOUT)) == base


def test_fingerprint_rejects_values_without_a_canonical_form():
    with pytest.raises(TypeError, match="set"):
        fingerprint({"experts": {1, 2}}, "w", LAYOUT)
