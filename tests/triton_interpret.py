"""One patch of Triton's CPU interpreter (TRITON_INTERPRET=1) for the test session: a device function called from a
kernel no longer re-patches triton.language when the launch already patched the modules it sees.

Why it is safe. The interpreter runs a kernel with triton.language's builtins swapped for numpy ones:
`GridExecutor.__call__` calls `_patch_lang(kernel)` once per launch and restores the modules after it. Every call of
a `@triton.jit` device function inside the kernel (`tl.sum`, `tl.zeros`, `tl.cdiv` are such functions too, and our
kernels call triton_common's helpers in their inner loops) calls `_patch_lang(helper)` again: it enumerates the
modules with `inspect.getmembers` and re-sets attributes that the launch already set (a builtin swapped once is no
builtin any more, so it is skipped; the rest are the same lambdas again). Within one launch nothing is restored
between those calls, so every call after the first for a given set of modules changes nothing; it cost about a
quarter of the interpreter's time in the kernel-path engine tests (measured 2026-12-06: 20,687 calls, 141 of
580 s profiled in tests/core/test_decode_step.py). Here the first call per launch for each set of modules still
runs (so `triton.language.core`, seen first by `tl.sum`'s module, is patched exactly as before) and the repeats
are skipped. Kernels compute the same values; every interpreter check stays as it was.

Second, `skip_dead_overflow_checks`: the interpreter's `sanitize_overflow` option (on by default there) redoes every
32-bit integer add, sub and mul of a kernel in int64 and builds the range comparison, then hands it to
`device_assert`, which returns at once unless the `debug` option is on (off, as in compiled kernels: a kernel
computing 3 * 2^30 in int32 ran without complaint with the option on). So the work checks nothing; it was ~20% of
an engine test's time (measured 2026-12-07: tests/core/test_decode_step.py's kernel-path test, 99 s with it, 77 s
without). Kernels compute the same values either way.

Applied only to the Triton version it was read from (3.6); any other version runs the interpreter as it is.
"""

from __future__ import annotations

import dataclasses
import inspect

PATCHED_VERSIONS = ("3.6.",)


def skip_repeated_lang_patches() -> bool:
    """Install the patch; True if it was installed (Triton 3.6 with the interpreter's expected names)."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if not triton.__version__.startswith(PATCHED_VERSIONS) or getattr(interpreter, "_dsv41_patched", False):
        return False
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    original = interpreter._patch_lang
    launch_call = interpreter.GridExecutor.__call__
    lang_modules = (tl, tl.core)
    langs_of: dict[object, frozenset[int]] = {}  # function -> ids of the language modules in its globals
    patched: set[int] | None = None  # during a launch: ids of the modules patched since it began

    def langs(fn) -> frozenset[int]:
        found = langs_of.get(fn)
        if found is None:
            found = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang_modules)
            langs_of[fn] = found
        return found

    def patch_lang(fn):
        if patched is None:
            return original(fn)
        mine = langs(fn)
        if mine and mine <= patched:
            return interpreter._LangPatchScope()  # nothing to undo: the launch's own scope restores
        scope = original(fn)
        patched.update(mine)
        return scope

    def launch(self, *args, **kwargs):
        nonlocal patched
        outer, patched = patched, set()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched = outer

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    interpreter._dsv41_patched = True
    return True


def skip_dead_overflow_checks() -> bool:
    """sanitize_overflow off while debug is off (Triton 3.6); True if it was turned off."""
    import triton
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not triton.__version__.startswith(PATCHED_VERSIONS) or options is None or options.debug:
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
