"""Engram row gather straight from the host-memory FP8 tables (EngramEmbedding.forward semantics, spec 4.3).

    out[t, c, :] = bf16( e4m3(weight[ids[t, c], :]) * 2^(scale[ids[t, c], :] - 127) per 32 )   (0 where id = -1)

The real tables are ~384M rows x (256 B FP8 + 8 B E8M0) = ~101 GB per Engram layer (two layers): they stay
in page-locked host memory and a decode token reads only 24 rows per layer. The kernel reads those rows
directly over PCIe (zero-copy): pinned host memory is mapped into the device's address space, and Triton
3.6's launcher translates every pointer argument with cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_
POINTER), which succeeds for cudaHostAlloc'd (torch.pin_memory) and for cudaHostRegister'd (mapped) memory.
So the CPU tensors are passed to the @triton.jit kernel as they are: no staging copy, no CUDA C++, and the
same kernel runs on CPU tensors under TRITON_INTERPRET=1 (and on a table that lives on the GPU).

Pinning in place: `HostEngramTable.from_embedding` registers the module's own buffers with
cudaHostRegister (portable | mapped) instead of calling pin_memory(): pin_memory copies the table (a
second ~101 GB), and torch's caching host allocator rounds the allocation up to a power of two (128 GB).

Exactness: an E4M3 value has <= 4 significant bits, so value * 2^(e - 127) is exact in fp32 and in bf16
(scale codes 1..254, results inside the normal fp32 range: what quantised rows always give). The kernel
decodes the FP8 bits with integer operations (the interpreter's fp8 casts are unreliable) and rounds to
bf16 with integer round-to-nearest-even (a no-op here), so it is bitwise EngramEmbedding.forward.
E4M3 NaN codes (0x7F, 0xFF) and E8M0 codes 0 and 255 are outside the contract (never in a quantised table).

Memory traffic (the floor): (dim + dim/32) B per valid id read from host memory over PCIe (264 B at
dim 256: two 128 B requests + one 8 B request), 8 B per id (device), 2 * dim B per id written (device).
At decode (24 rows per token and layer) the kernel is bound by one PCIe round trip (~1-2 us); at prefill
by the PCIe read rate. Ids of -1 (padding) and ids outside [0, rows) read nothing and give zero rows.

Overlap: the hash ids of both Engram layers are known from the token ids before layer 0 runs, so
`EngramPrefetch.launch` issues both gathers on a side stream at the start of the step and `wait(i)` joins
that stream just before Engram layer i (layers 1 and 14): the PCIe latency hides under layer 0's compute.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_common import bf16_bits, e8m0_to_fp32
from engine.model.engram import EngramEmbedding

SCALE_BLOCK = 32  # one E8M0 scale per 32 elements of a row
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


@triton.jit
def _e4m3_to_fp32_signed(b):
    """int32 E4M3 codes (0..255, no NaN) -> fp32, sign bit copied from the code so that 0x80 gives -0.0
    (triton_common.e4m3_to_fp32 negates with 0 - x, which turns -0 into +0: not bitwise the golden)."""
    e = (b >> 3) & 15
    m = b & 7
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # subnormal: m * 2^-9 (exact)
    mag = tl.where(e == 0, sub, ((e + 120) << 23) | (m << 20))
    return (mag | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _engram_gather_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, num_ids, C, ids_stride, rows,
                          D: tl.constexpr, BLOCK_R: tl.constexpr):
    G: tl.constexpr = D // 32
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (token, column) index
    in_range = r < num_ids
    row = tl.load(ids_ptr + (r // C).to(tl.int64) * ids_stride + r % C, mask=in_range, other=-1)  # int64
    valid = (row >= 0) & (row < rows)
    row = tl.where(valid, row, 0)
    ok = valid[:, None]
    cols = tl.arange(0, D)
    # host memory over PCIe (or device memory): 64-bit row offsets, rows * D exceeds 2^31 on real tables
    q = tl.load(w_ptr + row[:, None] * D + cols[None, :], mask=ok, other=0).to(tl.int32)  # [BR, D] E4M3 codes
    s = tl.load(s_ptr + row[:, None] * G + tl.arange(0, G)[None, :], mask=ok, other=127)  # [BR, G] E8M0 codes
    v = tl.reshape(_e4m3_to_fp32_signed(q), (BLOCK_R, G, 32)) * e8m0_to_fp32(s)[:, :, None]  # exact
    out = r.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_ptr + out, bf16_bits(tl.reshape(v, (BLOCK_R, D))), mask=in_range[:, None])


def _unregister(weight: Tensor, scale: Tensor) -> None:
    for t in (weight, scale):
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))


@dataclass(frozen=True, eq=False)
class HostEngramTable:
    """One Engram layer's table where the gather kernel can read it: FP8 rows [rows, dim] float8_e4m3fn and
    E8M0 scales [rows, dim/32] float8_e8m0fnu, contiguous. `pinned`: page-locked host memory that a CUDA
    kernel reads over PCIe; on a machine without CUDA the tensors are plain CPU tensors (pinned False).
    A table registered in place is unregistered when this object is collected (or by `close()`)."""

    weight: Tensor
    scale: Tensor
    pinned: bool
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    @staticmethod
    def from_embedding(embed: EngramEmbedding, in_place: bool = True) -> HostEngramTable:
        """The module's buffers, no copy. With CUDA present and the buffers in (unpinned) host memory:
        in_place pins them with cudaHostRegister (the 100 GB table is never copied); else pin_memory()
        copies them. Buffers already pinned, or on a GPU, are used as they are."""
        return HostEngramTable.from_tensors(embed.weight, embed.scale, in_place)

    @staticmethod
    def from_tensors(weight: Tensor, scale: Tensor, in_place: bool = True) -> HostEngramTable:
        assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, (
            f"weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
        rows, dim = weight.shape
        assert dim % SCALE_BLOCK == 0, f"row length {dim} is not a multiple of {SCALE_BLOCK}"
        assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (rows, dim // SCALE_BLOCK), (
            f"weight {tuple(weight.shape)} needs float8_e8m0fnu scale {(rows, dim // SCALE_BLOCK)}, "
            f"got {scale.dtype} {tuple(scale.shape)}")
        assert weight.is_contiguous() and scale.is_contiguous(), "weight and scale must be contiguous"
        assert weight.device == scale.device, f"weight on {weight.device}, scale on {scale.device}"
        if weight.is_cuda or not torch.cuda.is_available():
            return HostEngramTable(weight, scale, pinned=False)
        if weight.is_pinned() and scale.is_pinned():
            return HostEngramTable(weight, scale, pinned=True)
        if not in_place:
            return HostEngramTable(weight.pin_memory(), scale.pin_memory(), pinned=True)
        cudart = torch.cuda.cudart()
        for t in (weight, scale):
            assert not t.is_pinned(), "weight and scale must be pinned (or not) together"
            # read-only (e.g. mmapped) storage fails here: load the table into anonymous memory first
            torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                                                           _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        table = HostEngramTable(weight, scale, pinned=True)
        finalizer = weakref.finalize(table, _unregister, weight, scale)
        finalizer.atexit = False  # at exit the process's memory goes anyway (and CUDA may be torn down first)
        object.__setattr__(table, "_finalizer", finalizer)
        return table

    @property
    def rows(self) -> int:
        return self.weight.size(0)

    @property
    def dim(self) -> int:
        return self.weight.size(1)

    @property
    def row_bytes(self) -> int:
        return self.dim + self.dim // SCALE_BLOCK

    def close(self) -> None:
        """Unregister a table pinned in place (idempotent; the tensors stay valid host memory)."""
        if self._finalizer is not None:
            self._finalizer()


def engram_gather(table: HostEngramTable, ids: Tensor, out: Tensor | None = None, *,
                  block_rows: int = 16, num_warps: int = 4) -> Tensor:
    """Dequantised table rows: ids int64 [..., C] -> bf16 [..., C, dim] on ids' device (written into `out`
    when given: bf16, contiguous, that shape and device). ids in [-1, rows): -1 gives a zero row.

    ids on a CUDA device need a pinned host table (read over PCIe) or a table on that device; ids on the
    CPU need a CPU table (the interpreter). Equals engram_gather_ref bit for bit.
    """
    assert ids.dtype == torch.int64, f"ids must be int64, got {ids.dtype}"
    assert ids.dim() >= 1, "ids must have a hash-column dimension"
    if ids.is_cuda:
        assert table.pinned or table.weight.device == ids.device, (
            f"ids on {ids.device} need a pinned host table or one on that device (table on "
            f"{table.weight.device}, pinned={table.pinned})")
    else:
        assert table.weight.device.type == "cpu", f"CPU ids need a CPU table, got {table.weight.device}"
    assert block_rows & (block_rows - 1) == 0, f"block_rows must be a power of two, got {block_rows}"
    c, dim = ids.size(-1), table.dim
    shape = (*ids.shape, dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=ids.device)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == shape and out.is_contiguous(), (
        f"out must be contiguous bf16 {shape}, got {out.dtype} {tuple(out.shape)}")
    assert out.device == ids.device, f"out on {out.device}, ids on {ids.device}"
    num_ids = ids.numel()
    if num_ids == 0:
        return out
    ids2 = ids.reshape(-1, c)  # a view when it can be (a [T, L, C][:, l] slice keeps its row stride)
    if ids2.stride(-1) != 1:
        ids2 = ids2.contiguous()
    assert num_ids < 2**31, f"{num_ids} ids exceed int32 indexing"
    _engram_gather_kernel[(triton.cdiv(num_ids, block_rows),)](
        table.weight.view(torch.uint8), table.scale.view(torch.uint8), ids2, out.view(torch.int16),
        num_ids, c, ids2.stride(0), table.rows, D=dim, BLOCK_R=block_rows, num_warps=num_warps)
    return out


def engram_gather_ref(module: EngramEmbedding, ids: Tensor) -> Tensor:
    """The oracle: the golden EngramEmbedding.forward (gathered where the table lives, bf16 on ids' device),
    with -1 ids giving zero rows (the golden itself would index the last row)."""
    pad = (ids < 0).unsqueeze(-1)
    return module(ids.clamp_min(0)).masked_fill(pad, 0)


class EngramPrefetch:
    """Both Engram layers' gathers of one step, issued before layer 0 and joined just before each Engram layer.

        prefetch.launch(hash_ids)          # [..., num_layers, C] int64 on the device, before layer 0
        ...
        rows = prefetch.wait(engram_index)  # [..., C, dim] bf16, just before that Engram layer

    On CUDA the gathers run on a side stream (high priority: they are tiny and latency-bound, and must not
    queue behind the compute they overlap), each followed by its own event; `wait` makes the current
    stream wait on that layer's event only. Capturable in a CUDA graph provided every launched layer is
    waited on before the capture ends (the side stream must rejoin). On the CPU the gathers run in launch.
    """

    def __init__(self, tables: Sequence[HostEngramTable], device: torch.device | str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" -> "cuda:N", as tensors report it
            device = torch.device("cuda", torch.cuda.current_device())
        self.tables, self.device = list(tables), device
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self._rows: list[Tensor | None] = [None] * len(self.tables)
        self._events: list[torch.cuda.Event | None] = [None] * len(self.tables)

    def launch(self, hash_ids: Tensor) -> None:
        """Start every layer's gather; hash_ids [..., num_layers, C] int64 on this prefetcher's device."""
        assert hash_ids.device == self.device, f"hash_ids on {hash_ids.device}, prefetch for {self.device}"
        assert hash_ids.dim() >= 2 and hash_ids.size(-2) == len(self.tables), (
            f"hash_ids {tuple(hash_ids.shape)} must be [..., {len(self.tables)}, C]")
        for i, rows in enumerate(self._rows):  # a step that raised left them: rejoin the side stream, drop them
            if rows is not None:
                self.wait(i)
        if self.stream is None:
            self._rows = [engram_gather(t, hash_ids[..., i, :]) for i, t in enumerate(self.tables)]
            return
        current = torch.cuda.current_stream(self.device)
        outs = [torch.empty((*hash_ids.shape[:-2], hash_ids.size(-1), t.dim), dtype=torch.bfloat16,
                            device=self.device) for t in self.tables]  # owned by the current stream
        self.stream.wait_stream(current)  # the ids are written on the current stream
        with torch.cuda.stream(self.stream):
            for i, (t, out) in enumerate(zip(self.tables, outs)):
                engram_gather(t, hash_ids[..., i, :], out)
                self._events[i] = torch.cuda.Event()
                self._events[i].record(self.stream)
        hash_ids.record_stream(self.stream)  # not reused by the allocator while the side stream reads it
        for out in outs:
            out.record_stream(self.stream)
        self._rows = outs

    def wait(self, engram_index: int) -> Tensor:
        """Layer `engram_index`'s rows (its position in cfg.engram_layer_ids), ordered before the current
        stream's next work; each launch's rows are returned once."""
        rows = self._rows[engram_index]
        assert rows is not None, f"Engram layer {engram_index}: wait without a launch"
        self._rows[engram_index] = None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._events[engram_index])
            self._events[engram_index] = None
        return rows
