import time

import numpy as np
import pytest
import tokenizers
import torch

import engine.engram_tables as et
from engine.engram_tables import (
    DEAD,
    EngramTables,
    build_compressed_token_map,
    compute_compressed_token_map,
    engram_multipliers,
    engram_offsets,
    engram_primes,
    hash_ngrams,
    initial_history,
    is_prime,
    next_history,
    token_map_cache_name,
)
from engine.tokenizer import load_tokenizer, package_file, write_tokenizer_files

# the released config (spec 2.2 / 4.3)
LAYERS, MAX_N, HEADS, VOCAB_START, PAD = (1, 14), 4, 8, 16000000, 2
MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    write_tokenizer_files(out)
    return load_tokenizer(out)


@pytest.fixture(scope="module")
def token_map(tok):
    t0 = time.perf_counter()
    cold = build_compressed_token_map(tok)
    t1 = time.perf_counter()
    cached = build_compressed_token_map(tok.path)
    t2 = time.perf_counter()
    print(f"\nEngram token map: cold build {t1 - t0:.2f} s, cached load {(t2 - t1) * 1e3:.1f} ms")
    assert np.array_equal(cold[0], cached[0]) and cold[1] == cached[1]
    return cold


@pytest.fixture(scope="module")
def tables(token_map):
    return EngramTables.build(*token_map, LAYERS, MAX_N, HEADS, VOCAB_START, PAD)


def test_token_map_on_v41_tokenizer(tok, token_map):
    mapping, num_compressed = token_map
    assert num_compressed == 99092
    assert mapping.dtype == np.int64 and mapping.shape == (129280,)
    assert mapping[0] == 0 and mapping[2] == 2 and mapping.max() == 99091
    assert (tok.path.parent / token_map_cache_name(tok.path.read_bytes())).is_file()
    # case, accents and a leading space fold together
    same = [tok.token_to_id(t) for t in ("The", "Ġthe", "THE")]
    assert None not in same and len({int(mapping[i]) for i in same}) == 1


def test_v4_and_v41_maps_agree(token_map):
    v4 = tokenizers.Tokenizer.from_file(str(package_file("tokenizer.json")))
    v4_map, v4_num = compute_compressed_token_map(v4)
    assert v4_num == token_map[1] and np.array_equal(v4_map, token_map[0])


def test_cache_falls_back_when_folder_is_read_only(tok, token_map, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "tokenizer.json").write_bytes(tok.path.read_bytes())
    real_save = et._save_atomic

    def save(path, arr):
        if path.parent == ro:
            raise PermissionError(13, "Read-only file system", str(path))
        real_save(path, arr)

    monkeypatch.setattr(et, "_save_atomic", save)
    monkeypatch.setattr(et, "compute_compressed_token_map", lambda backend: token_map)
    user = tmp_path / "user"
    mapping, num = build_compressed_token_map(ro / "tokenizer.json", cache_dir=user)
    assert num == 99092 and not list(ro.glob("*.npy"))
    assert [p.name for p in user.iterdir()] == [token_map_cache_name(tok.path.read_bytes())]
    monkeypatch.setattr(et, "compute_compressed_token_map", lambda backend: pytest.fail("cache missed"))
    again, _ = build_compressed_token_map(ro / "tokenizer.json", cache_dir=user)
    assert np.array_equal(again, mapping)


def test_corrupt_cache_is_loud(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(tok.path.read_bytes())
    np.save(tmp_path / token_map_cache_name(tok.path.read_bytes()), np.array([0, 2, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="first-appearance"):
        build_compressed_token_map(tmp_path / "tokenizer.json", cache_dir=tmp_path / "user")


def test_is_prime():
    def trial(n):
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(5000) if is_prime(n)] == [n for n in range(5000) if trial(n)]
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1) and not is_prime(3215031751)


def test_primes_of_released_config():
    primes = engram_primes(LAYERS, MAX_N, HEADS, VOCAB_START)
    assert [len(p) for p in primes] == [24, 24]
    assert [sum(p) for p in primes] == [384006168, 384016682]
    assert primes[0][:3] == [16000057, 16000079, 16000081]
    assert primes[1][0] == 16000477
    flat = primes[0] + primes[1]
    assert len(set(flat)) == 48 and all(is_prime(p) and p > VOCAB_START - 1 for p in flat)
    # with `seen` global, restarting per order changes nothing: layer 1 takes the first 24 primes
    # above the start in column order, layer 14 the next 24
    assert flat == sorted(flat)
    assert all(not is_prime(n) for n in range(VOCAB_START, flat[-1]) if n not in set(flat))
    offsets = engram_offsets(primes[0])
    assert offsets[:3] == [0, 16000057, 16000057 + 16000079]
    assert offsets[-1] + primes[0][-1] == 384006168


def test_primes_small_config_brute_force():
    def brute(layers, max_n, heads, start):
        seen, out = set(), []
        for _ in layers:
            row = []
            for _ in range(max_n - 1):
                cur = start - 1
                for _ in range(heads):
                    cur += 1
                    while any(cur % d == 0 for d in range(2, cur)) or cur in seen:
                        cur += 1
                    seen.add(cur)
                    row.append(cur)
            out.append(row)
        return out

    assert engram_primes((0, 3, 5), 3, 2, 50) == brute((0, 3, 5), 3, 2, 50)
    assert engram_primes((0, 3, 5), 3, 2, 50)[0] == [53, 59, 61, 67]


def test_multipliers():
    for layer, expected in MULTIPLIERS.items():
        got = engram_multipliers(layer, 99092, MAX_N)
        assert got.dtype == np.int64 and got.tolist() == expected
        assert all(m % 2 == 1 and m * 99091 < 2**63 for m in expected)


def test_tables(tables):
    assert tables.pad_id == 2 and tables.num_hash_cols == 24
    assert tables.num_embeddings == (384006168, 384016682)
    assert tables.multipliers.tolist() == [MULTIPLIERS[1], MULTIPLIERS[14]]
    assert tables.token_map.dtype == torch.int64 and tables.primes.dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# hashing against a plain-Python reference
# ---------------------------------------------------------------------------------------------


def reference_hashes(token_map, pad, primes, multipliers, max_n, heads, ids, live):
    """hash[p][layer][col] for one sequence starting at position 0, with Python ints."""
    c = [int(token_map[i]) if ok else DEAD for i, ok in zip(ids, live)]
    out = []
    for p in range(len(c)):
        t, blocked = [], False
        for s in range(max_n):
            if p < s or c[p - s] == DEAD:
                blocked = True
            t.append(pad if blocked else c[p - s])
        per_layer = []
        for layer_primes, mult in zip(primes, multipliers):
            offsets = [sum(layer_primes[:k]) for k in range(len(layer_primes))]
            rolling, cols = t[0] * mult[0], []
            for n in range(1, max_n):
                assert t[n] * mult[n] < 2**63
                rolling ^= t[n] * mult[n]
                for j in range(heads):
                    col = (n - 1) * heads + j
                    cols.append(rolling % layer_primes[col] + offsets[col])
            per_layer.append(cols)
        out.append(per_layer)
    return out


def released_reference(token_map, ids, live):
    primes = engram_primes(LAYERS, MAX_N, HEADS, VOCAB_START)
    mults = [MULTIPLIERS[layer] for layer in LAYERS]
    return reference_hashes(token_map[0], int(token_map[0][PAD]), primes, mults, MAX_N, HEADS, ids, live)


@pytest.fixture(scope="module")
def batch(tok):
    texts = [
        "<｜begin▁of▁sentence｜><｜User｜>The quick brown fox, THE QUICK fox. Again!",
        "深度求索 emoji 🙂 x = 12345; y = 6",
    ]
    ids = [tok.encode(t)[:13] for t in texts]
    assert all(len(x) == 13 for x in ids)
    live = [[True] * 13, [True] * 13]
    live[0][5] = False  # one image token
    live[1][2] = live[1][3] = False  # two in a row
    return torch.tensor(ids), torch.tensor(live)


def test_hash_matches_python_reference(tables, token_map, batch):
    ids, live = batch
    got = hash_ngrams(tables, ids, initial_history(tables, 2), 0, live)
    assert got.shape == (2, 13, 2, 24) and got.dtype == torch.int64
    for b in range(2):
        expected = released_reference(token_map, ids[b].tolist(), live[b].tolist())
        assert got[b].tolist() == expected, f"row {b}"
    rows = torch.tensor(tables.num_embeddings).view(1, 1, 2, 1)
    assert bool((got >= 0).all()) and bool((got < rows).all())


def test_blocking_at_start_and_at_dead(tables, batch):
    ids, live = batch
    full = hash_ngrams(tables, ids, initial_history(tables, 2), 0, live)
    all_pad = hash_ngrams(tables, torch.tensor([[PAD]]), initial_history(tables, 1), 0)[0, 0]
    assert torch.equal(full[0, 5], all_pad)  # a DEAD token hashes as all pad
    # just after the DEAD token look-back restarts as at position 0
    restart = hash_ngrams(tables, ids[:1, 6:9], initial_history(tables, 1), 0)
    assert torch.equal(full[0, 6:9], restart[0])
    # order 2 at p=0 hashes (c0, pad): differs from order 2 at p=1 unless the tokens repeat
    assert not torch.equal(full[0, 0, :, :8], full[0, 1, :, :8])


@pytest.mark.parametrize("chunks", [[1] * 13, [3, 4, 1, 5], [2, 11]])
def test_incremental_equals_one_call(tables, batch, chunks):
    ids, live = batch
    full = hash_ngrams(tables, ids, initial_history(tables, 2), 0, live)
    history, pos, parts = initial_history(tables, 2), 0, []
    for n in chunks:
        step_ids, step_live = ids[:, pos : pos + n], live[:, pos : pos + n]
        parts.append(hash_ngrams(tables, step_ids, history, pos, step_live))
        history = next_history(tables, history, step_ids, step_live)
        pos += n
    assert torch.equal(torch.cat(parts, dim=1), full)


def test_rows_at_different_positions(tables, batch):
    ids, live = batch
    full = hash_ngrams(tables, ids, initial_history(tables, 2), 0, live)
    starts = [2, 9]  # row 0 sits right after position 1, row 1 after 8
    history = torch.stack(
        [
            next_history(tables, initial_history(tables, 1), ids[b : b + 1, :s], live[b : b + 1, :s])[0]
            for b, s in enumerate(starts)
        ]
    )
    step_ids = torch.stack([ids[b, s : s + 3] for b, s in enumerate(starts)])
    step_live = torch.stack([live[b, s : s + 3] for b, s in enumerate(starts)])
    got = hash_ngrams(tables, step_ids, history, torch.tensor(starts), step_live)
    for b, s in enumerate(starts):
        assert torch.equal(got[b], full[b, s : s + 3])


def test_small_config_odd_shapes():
    rng = np.random.default_rng(0)
    token_map = np.array([0, 1, 0, 2, 3, 1, 4, 5, 2, 6, 6], dtype=np.int64)  # 11 ids -> 7 compressed
    layers, max_n, heads, pad = (0, 3, 7), 3, 3, 4
    tables = EngramTables.build(token_map, 7, layers, max_n, heads, 40, pad)
    ids = torch.from_numpy(rng.integers(0, 11, size=(3, 17)))
    live = torch.from_numpy(rng.random((3, 17)) > 0.2)
    got = hash_ngrams(tables, ids, initial_history(tables, 3), 0, live)
    assert got.shape == (3, 17, 3, 6)
    primes = engram_primes(layers, max_n, heads, 40)
    bound = (2**63 - 1) // 7 // 2
    mults = [
        (np.random.default_rng(10007 * layer).integers(0, bound, size=max_n, dtype=np.int64) * 2 + 1).tolist()
        for layer in layers
    ]
    for b in range(3):
        expected = reference_hashes(
            token_map, int(token_map[pad]), primes, mults, max_n, heads, ids[b].tolist(), live[b].tolist()
        )
        assert got[b].tolist() == expected, f"row {b}"
