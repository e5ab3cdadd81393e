"""Engram row gather (FP8 rows x E8M0 scales -> bf16) vs the golden EngramEmbedding.forward: bitwise.

Dequantisation is exact (an E4M3 value times a power of two fits bf16), so every test demands bitwise
equality with engram_gather_ref, i.e. the golden module's forward (-1 ids: zero rows). Tables hold every
finite E4M3 code (both zeros, subnormals, +-448) and scale codes 10..246 (products stay normal fp32).
"""

import pytest
import torch

from engine.kernels.engram_gather import EngramPrefetch, HostEngramTable, engram_gather, engram_gather_ref
from engine.model.engram import EngramEmbedding
from engine.presets import full_config

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FINITE_E4M3 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes


def _fill(embed: EngramEmbedding, seed: int = 0, device: str = "cpu") -> EngramEmbedding:
    """Random E4M3 rows cycling through every finite code, random E8M0 scales in 10..246 (in place)."""
    g = torch.Generator(device).manual_seed(seed)
    rows, dim = embed.weight.shape
    codes = FINITE_E4M3.to(device)[torch.randint(0, 254, (rows, dim), generator=g, device=device)]
    first = min(rows * dim, 254)
    codes.view(-1)[:first] = FINITE_E4M3.to(device)[:first]
    embed.weight.view(torch.uint8).copy_(codes)
    embed.scale.view(torch.uint8).copy_(torch.randint(10, 247, embed.scale.shape, generator=g, device=device,
                                                      dtype=torch.uint8))
    return embed


def _embedding(rows: int, dim: int, seed: int = 0) -> EngramEmbedding:
    return _fill(EngramEmbedding(rows, dim), seed)


def _ids(t: int, c: int, rows: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """Random ids with the last row, the first row, a repeated id and a -1 (padding) among them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (t, c), generator=g)
    flat = ids.view(-1)
    flat[0] = rows - 1
    if flat.numel() > 3:
        flat[1], flat[2], flat[3] = 0, flat[-1], -1
    return ids.to(device)


def assert_bitwise(out: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    o, r = out.view(torch.int16).cpu(), ref.view(torch.int16).cpu()
    bad = o != r
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.numel()} elements differ; first at {idx} "
                    f"(id {int(ids.cpu()[idx[:-1]])}): out {out.cpu()[idx].item()!r} ref {ref.cpu()[idx].item()!r}")


# --- CPU (TRITON_INTERPRET=1) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,dim,t,c", [(97, 32, 1, 6), (97, 32, 5, 6), (41, 256, 1, 24), (41, 256, 5, 24),
                                          (13, 64, 3, 5)])
def test_gather_matches_golden(rows, dim, t, c):
    embed = _embedding(rows, dim)
    table = HostEngramTable.from_embedding(embed)
    ids = _ids(t, c, rows, seed=t)
    out = engram_gather(table, ids)
    assert_bitwise(out, engram_gather_ref(embed, ids), ids, f"rows={rows} dim={dim} T={t} C={c}")
    ok = ids >= 0
    golden = embed(ids.clamp_min(0))  # the golden module itself, on the non-padding ids
    assert torch.equal(out[ok].view(torch.int16), golden[ok].view(torch.int16))
    assert not out[~ok].view(torch.int16).any(), "padding ids must give +0 rows"


def test_every_code_and_block_rows():
    """All 254 finite E4M3 codes x 40 scale codes in one table, read through several program sizes."""
    embed = EngramEmbedding(254, 32)
    scales = torch.arange(80, 200, 3, dtype=torch.uint8)[:40]
    embed.weight.view(torch.uint8).copy_(FINITE_E4M3.view(254, 1).expand(254, 32)
                                         .reshape(-1)[torch.randperm(254 * 32, generator=torch.Generator().manual_seed(5))].view(254, 32))
    embed.scale.view(torch.uint8).copy_(scales[torch.arange(254) % 40].view(254, 1))
    table = HostEngramTable.from_embedding(embed)
    ids = torch.arange(254).view(2, 127)
    ref = engram_gather_ref(embed, ids)
    for block_rows in (1, 8, 32):
        assert_bitwise(engram_gather(table, ids, block_rows=block_rows), ref, ids, f"block_rows={block_rows}")


def test_strided_ids_out_and_empty():
    embed = _embedding(50, 32, seed=1)
    table = HostEngramTable.from_embedding(embed)
    both = torch.randint(0, 50, (3, 2, 7))  # [T, layers, C]: one layer's slice has row stride 14
    both[1, 1, 4] = -1
    for layer in range(2):
        ids = both[:, layer]
        out = torch.full((3, 7, 32), float("nan"), dtype=torch.bfloat16)
        assert engram_gather(table, ids, out) is out
        assert_bitwise(out, engram_gather_ref(embed, ids), ids, f"layer {layer}")
    ids_t = both[:, 0].t()  # last-dim stride != 1: gathered from a contiguous copy
    assert_bitwise(engram_gather(table, ids_t), engram_gather_ref(embed, ids_t), ids_t, "transposed ids")
    batched = both[:, 1].view(1, 3, 7)  # leading dims [B, S]
    assert_bitwise(engram_gather(table, batched), engram_gather_ref(embed, batched), batched, "[B, S, C]")
    empty = engram_gather(table, torch.empty(0, 7, dtype=torch.int64))
    assert empty.shape == (0, 7, 32) and empty.dtype == torch.bfloat16


def test_out_of_range_ids_read_nothing():
    embed = _embedding(20, 32, seed=2)
    ids = torch.tensor([[19, 20, -1, 1 << 40, -5, 0]])
    out = engram_gather(HostEngramTable.from_embedding(embed), ids)
    assert not out[0, 1:5].view(torch.int16).any()
    assert_bitwise(out[:, [0, 5]], engram_gather_ref(embed, ids[:, [0, 5]]), ids[:, [0, 5]], "in-range ids")


def test_table_holds_module_storage_and_contract():
    embed = _embedding(10, 32)
    table = HostEngramTable.from_embedding(embed)
    assert table.weight.data_ptr() == embed.weight.data_ptr() and table.scale.data_ptr() == embed.scale.data_ptr()
    assert (table.rows, table.dim, table.row_bytes) == (10, 32, 33)
    with pytest.raises(AssertionError, match="int64"):
        engram_gather(table, torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(AssertionError, match="scale"):
        HostEngramTable.from_tensors(embed.weight, embed.scale[:, :0])
    table.close()  # nothing registered on a CPU machine: a no-op


def test_prefetch_cpu_matches_sync(tiny_cfg):
    """Two Engram layers at the tiny config's head dim and hash-column count, real row counts."""
    c, dim = tiny_cfg.n_hash_cols, tiny_cfg.engram_head_dim
    embeds = [_embedding(rows, dim, seed=i) for i, rows in enumerate(tiny_cfg.engram_num_embeddings)]
    tables = [HostEngramTable.from_embedding(e) for e in embeds]
    hash_ids = torch.stack([_ids(5, c, e.weight.size(0), seed=i) for i, e in enumerate(embeds)], dim=1)  # [T, 2, C]
    prefetch = EngramPrefetch(tables, "cpu")
    for _ in range(2):  # a second step reuses the prefetcher
        prefetch.launch(hash_ids)
        for i, e in enumerate(embeds):
            assert_bitwise(prefetch.wait(i), engram_gather_ref(e, hash_ids[:, i]), hash_ids[:, i], f"layer {i}")
    with pytest.raises(AssertionError, match="without a launch"):
        prefetch.wait(0)


# --- GPU (real shapes) ----------------------------------------------------------------------------------------


def _host_embedding(rows: int, dim: int, seed: int) -> EngramEmbedding:
    """A table in plain (pageable) host memory, filled on the GPU for speed."""
    embed = EngramEmbedding(rows, dim)
    dev = _fill(EngramEmbedding(rows, dim).cuda(), seed, device="cuda")
    embed.weight.copy_(dev.weight)
    embed.scale.copy_(dev.scale)
    return embed


@pytest.fixture(scope="module")
def big_table():
    """4M rows x 264 B (~1.1 GB) pinned in place: the production path for the 101 GB tables."""
    cfg = full_config()
    embed = _host_embedding(4 << 20, cfg.engram_head_dim, seed=0)
    ptr = embed.weight.data_ptr()
    table = HostEngramTable.from_embedding(embed)
    assert table.pinned and embed.weight.is_pinned() and embed.scale.is_pinned()
    assert table.weight.device.type == "cpu" and table.weight.data_ptr() == ptr, "pinned by a copy"
    yield embed, table
    table.close()
    assert not embed.weight.is_pinned()


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 6, 64, 4096])
def test_gpu_gather_bitwise(big_table, t):
    embed, table = big_table
    c = full_config().n_hash_cols
    ids = _ids(t, c, table.rows, seed=t, device="cuda")
    out = engram_gather(table, ids)
    torch.cuda.synchronize()
    assert out.is_cuda
    assert_bitwise(out, engram_gather_ref(embed, ids), ids, f"T={t} C={c} dim={table.dim}")


@gpu
@needs_cuda
def test_gpu_pin_memory_copy_and_device_table():
    embed = _host_embedding(1000, 256, seed=3)
    ids = _ids(7, 24, 1000, device="cuda")
    ref = engram_gather_ref(embed, ids)
    copied = HostEngramTable.from_embedding(embed, in_place=False)
    assert copied.pinned and copied.weight.data_ptr() != embed.weight.data_ptr() and not embed.weight.is_pinned()
    assert_bitwise(engram_gather(copied, ids), ref, ids, "pin_memory() copy")
    on_gpu = HostEngramTable.from_tensors(embed.weight.cuda(), embed.scale.cuda())
    assert_bitwise(engram_gather(on_gpu, ids), ref, ids, "table in device memory")


@gpu
@needs_cuda
def test_gpu_prefetch_overlaps_and_matches_sync(big_table):
    embed, table = big_table
    second = HostEngramTable.from_tensors(table.weight[: 1 << 20], table.scale[: 1 << 20])  # already pinned
    tables = [table, second]
    c = full_config().n_hash_cols
    hash_ids = torch.stack([_ids(64, c, t.rows, seed=i, device="cuda") for i, t in enumerate(tables)], dim=1)
    sync = [engram_gather(t, hash_ids[:, i]) for i, t in enumerate(tables)]
    prefetch = EngramPrefetch(tables, "cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(3):
        prefetch.launch(hash_ids)
        x = a @ a  # compute on the current stream while the gathers run on the side stream
        rows0 = prefetch.wait(0)
        used = rows0.clone()  # read on the current stream right after the wait: must see the finished gather
        rows1 = prefetch.wait(1)
        torch.cuda.synchronize()
        for i, rows in enumerate((used, rows1)):
            assert_bitwise(rows, sync[i], hash_ids[:, i], f"prefetch layer {i}")

    # captured in a CUDA graph (the served decode step is): replays follow new ids written in place
    static_ids = hash_ids.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        prefetch.launch(static_ids)
        prefetch.wait(0), prefetch.wait(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefetch.launch(static_ids)
        x = a @ a
        outs = [prefetch.wait(0), prefetch.wait(1)]
    for seed in (10, 11):
        new = torch.stack([_ids(64, c, t.rows, seed=seed + i, device="cuda") for i, t in enumerate(tables)], dim=1)
        static_ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        for i, t in enumerate(tables):
            assert_bitwise(outs[i], engram_gather(t, new[:, i]), new[:, i], f"graph replay layer {i}")
    assert torch.equal(outs[0], engram_gather_ref(embed, static_ids[:, 0]))
