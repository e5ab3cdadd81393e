"""A bounds checker for Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1); test-only.

On a GPU an out-of-bounds load or store faults only when the address happens to be unmapped, so a
kernel that reads a row past its tensor can pass alone and crash after other tests changed the
allocation layout. Under the interpreter every access is an explicit numpy array of byte addresses,
so it can be checked exactly:

    with BoundsChecker() as bc:
        kernel_wrapper(...)           # any number of launches, any kernels
    assert not bc.violations, bc.report()

While active, every launch records the extent of each tensor argument, [lowest byte, highest byte + 1)
of the elements its sizes and strides reach (the tensor's own extent, not its storage's), and every
load, store and atomic checks each active lane (mask true) against those extents: an access of
`itemsize` bytes at address a is in bounds iff some argument has lo <= a and a + itemsize <= hi. A
violation is recorded once per (kernel, op, nearest argument) with the count of lanes, the element
offsets relative to that argument's start and the first program id that made it; `report()` formats
them. `storage_ok=True` relaxes the rule to the argument's whole storage (views reaching into their
base tensor). Implementation: monkeypatches GridExecutor._init_args_hst / __call__ and the
InterpreterBuilder memory ops for the duration of the `with`, and restores them after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Violation:
    kernel: str
    op: str                  # "load" | "store" | "atomic_rmw" | "atomic_cas"
    arg: str                 # the argument whose start is nearest below the address ("?" if none)
    arg_numel: int           # elements in that argument's extent
    count: int = 0           # out-of-bounds lanes (summed over launches and programs)
    min_off: int = 0         # element offsets from the argument's start (offset >= arg_numel: past its end)
    max_off: int = 0
    max_past_end: int = 0    # most elements past the end of the argument's extent (over launches)
    first_pid: tuple = ()
    launches: set = field(default_factory=set)

    def __str__(self) -> str:
        return (f"{self.kernel}: {self.op} of {self.arg} at element offsets {self.min_off}..{self.max_off} "
                f"(first extent {self.arg_numel} elements; up to {self.max_past_end} elements past the end), "
                f"{self.count} lanes in {len(self.launches)} launch(es), first at program {self.first_pid}")


def _extent(t: torch.Tensor, storage: bool) -> tuple[int, int, int]:
    """(lo, hi, itemsize) in bytes of the elements a tensor's sizes/strides reach (or of its storage)."""
    es = t.element_size()
    if storage:
        st = t.untyped_storage()
        return st.data_ptr(), st.data_ptr() + st.nbytes(), es
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr(), es
    lo = sum(min(0, (s - 1) * d) for s, d in zip(t.shape, t.stride()))
    hi = sum(max(0, (s - 1) * d) for s, d in zip(t.shape, t.stride())) + 1
    return t.data_ptr() + lo * es, t.data_ptr() + hi * es, es


class BoundsChecker:
    def __init__(self, storage_ok: bool = False):
        self.storage_ok = storage_ok
        self.violations: dict[tuple, Violation] = {}
        self.launches = 0
        self._ctx: list[tuple[str, list[tuple[str, int, int, int]]]] = []
        self._saved: list = []

    # ---- launch bookkeeping --------------------------------------------------------------------------------
    def _args(self, names, args_hst, kwargs_hst) -> list[tuple[str, int, int, int]]:
        out = []

        def add(name, a):
            if isinstance(a, (tuple, list)):
                for i, x in enumerate(a):
                    add(f"{name}[{i}]", x)
                return
            base = getattr(a, "base", None) if not isinstance(a, torch.Tensor) else a
            if isinstance(base, torch.Tensor):
                out.append((name, *_extent(base, self.storage_ok)))

        for i, a in enumerate(args_hst):
            add(names[i] if i < len(names) else f"arg{i}", a)
        for k, a in kwargs_hst.items():
            add(k, a)
        return out

    def _check(self, op: str, ptrs, mask, elem_ty) -> None:
        if not self._ctx:
            return
        kernel, extents = self._ctx[-1]
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
            addr = addr[m]
        addr = addr.reshape(-1).astype(np.int64)
        if addr.size == 0:
            return
        es = max(1, elem_ty.primitive_bitwidth // 8)
        ok = np.zeros(addr.shape, dtype=bool)
        for _, lo, hi, _ in extents:
            ok |= (addr >= lo) & (addr + es <= hi)
        if ok.all():
            return
        from triton.runtime.interpreter import interpreter_builder

        pid = tuple(int(x) for x in interpreter_builder.grid_idx)
        bad = addr[~ok]
        # attribute each bad lane to the argument with the greatest start <= address (else the lowest one)
        starts = np.array([lo for _, lo, _, _ in extents], dtype=np.int64) if extents else np.zeros(0, np.int64)
        for a in np.unique(bad):
            below = np.nonzero(starts <= a)[0]
            j = below[np.argmax(starts[below])] if below.size else (int(np.argmin(starts)) if starts.size else -1)
            if j < 0:
                name, lo, numel, aes = "?", 0, 0, es
            else:
                name, lo, hi, aes = extents[j]
                numel = (hi - lo) // aes
            key = (kernel, op, name)
            v = self.violations.get(key)
            off = (int(a) - lo) // aes
            n = int((bad == a).sum())
            if v is None:
                v = self.violations[key] = Violation(kernel, op, name, numel, min_off=off, max_off=off,
                                                     max_past_end=off - numel + 1, first_pid=pid)
            v.count += n
            v.min_off, v.max_off = min(v.min_off, off), max(v.max_off, off)
            v.max_past_end = max(v.max_past_end, off - numel + 1)
            v.launches.add(self.launches)

    # ---- patching ------------------------------------------------------------------------------------------
    def __enter__(self) -> BoundsChecker:
        from triton.runtime import interpreter as it

        chk = self
        GE, IB = it.GridExecutor, it.InterpreterBuilder
        orig = dict(init=GE._init_args_hst, call=GE.__call__, mload=IB.create_masked_load,
                    mstore=IB.create_masked_store, rmw=IB.create_atomic_rmw, cas=IB.create_atomic_cas)
        self._saved = [(GE, "_init_args_hst", orig["init"]), (GE, "__call__", orig["call"]),
                       (IB, "create_masked_load", orig["mload"]), (IB, "create_masked_store", orig["mstore"]),
                       (IB, "create_atomic_rmw", orig["rmw"]), (IB, "create_atomic_cas", orig["cas"])]

        def init_args(self, args_dev, kwargs):
            args_hst, kwargs_hst = orig["init"](self, args_dev, kwargs)
            chk._ctx[-1] = (chk._ctx[-1][0], chk._args(self.arg_names, args_hst, kwargs_hst))
            return args_hst, kwargs_hst

        def call(self, *args, **kwargs):
            chk._ctx.append((getattr(self.fn, "__name__", str(self.fn)), []))
            chk.launches += 1
            try:
                return orig["call"](self, *args, **kwargs)
            finally:
                chk._ctx.pop()

        def mload(self, ptrs, mask, other, *a):
            chk._check("load", ptrs, mask, ptrs.get_element_ty())
            return orig["mload"](self, ptrs, mask, other, *a)

        def mstore(self, ptrs, value, mask, *a):
            chk._check("store", ptrs, mask, ptrs.get_element_ty())
            return orig["mstore"](self, ptrs, value, mask, *a)

        def rmw(self, op, ptr, val, mask, *a):
            chk._check("atomic_rmw", ptr, mask, ptr.get_element_ty())
            return orig["rmw"](self, op, ptr, val, mask, *a)

        def cas(self, ptr, cmp, val, *a):
            chk._check("atomic_cas", ptr, None, ptr.get_element_ty())
            return orig["cas"](self, ptr, cmp, val, *a)

        GE._init_args_hst, GE.__call__ = init_args, call
        IB.create_masked_load, IB.create_masked_store = mload, mstore
        IB.create_atomic_rmw, IB.create_atomic_cas = rmw, cas
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)
        self._saved = []

    def report(self) -> str:
        if not self.violations:
            return f"no out-of-bounds access in {self.launches} launches"
        return "\n".join(str(v) for v in self.violations.values())
