"""Every Triton kernel reads only the module globals a GPU compile accepts. The CPU interpreter
(TRITON_INTERPRET=1) runs kernels as Python and lets them read any global, so a plain `DEAD = 0` used
inside a kernel passes every CPU test and fails only when the kernel is compiled on a GPU (it did:
decode_meta's DEAD, H100, 2026-12-05). Triton's rule (triton/compiler/code_generator.py, global_lookup):
a global must be a tl.constexpr, a module, another jitted function, a triton.language member or dtype."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import triton
import triton.language as tl
from triton.runtime.jit import JITCallable, KernelInterface

import engine.kernels


def compile_accepts(value: object) -> bool:
    return (isinstance(value, (types.ModuleType, JITCallable, KernelInterface, tl.constexpr, tl.dtype))
            or getattr(value, "__module__", "").startswith("triton.language")
            or getattr(value, "__triton_builtin__", False) or getattr(value, "__triton_aggregate__", False))


def python_function(kernel: KernelInterface) -> types.FunctionType:
    """The Python function under a jitted kernel (compiled or interpreted, autotuned or not)."""
    fn = kernel
    while not isinstance(fn, types.FunctionType):
        fn = fn.fn
    return fn


def refused_globals(kernel: KernelInterface) -> list[str]:
    """The names a kernel's body reads from its module's globals that a GPU compile would refuse."""
    fn = python_function(kernel)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    local = {a.arg for a in func.args.args + func.args.kwonlyargs}
    local |= {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    scope = fn.__globals__
    read = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(name for name in read - local
                  if name in scope and not hasattr(builtins, name) and not compile_accepts(scope[name]))


def kernels_of(module: types.ModuleType) -> list[KernelInterface]:
    return [v for v in vars(module).values()
            if isinstance(v, KernelInterface) and python_function(v).__module__ == module.__name__]


def test_every_kernel_reads_only_globals_a_gpu_compile_accepts():
    modules = [importlib.import_module(f"engine.kernels.{m.name}") for m in pkgutil.iter_modules(engine.kernels.__path__)]
    kernels = [k for m in modules for k in kernels_of(m)]
    assert len(kernels) >= 30, f"found only {len(kernels)} jitted kernels"  # the scan reaches them
    refused = {f"{m.__name__}.{python_function(k).__name__}": names for m in modules for k in kernels_of(m)
               if (names := refused_globals(k))}
    assert not refused, f"kernels reading non-constexpr globals (the GPU compile refuses them): {refused}"


PLAIN = 7
WRAPPED = tl.constexpr(7)


@triton.jit
def _reads_plain(out_ptr):
    tl.store(out_ptr, PLAIN)


@triton.jit
def _reads_wrapped(out_ptr, N: tl.constexpr):
    k = WRAPPED + N
    tl.store(out_ptr, k)


def test_the_scan_flags_a_plain_global_and_passes_a_constexpr_one():
    assert refused_globals(_reads_plain) == ["PLAIN"]
    assert refused_globals(_reads_wrapped) == []
