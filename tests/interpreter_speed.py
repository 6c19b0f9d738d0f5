"""Skip the Triton interpreter's redundant re-patching of ``triton.language`` (CPU tests only).

Triton 3.6's interpreter patches the builtins of ``triton.language`` (each one wrapped to
run on numpy) when a kernel launch starts, and restores them when it ends. It also calls
the same patching (``interpreter._patch_lang``) on every call of a ``@triton.jit`` helper
from inside a running kernel: a scan of ``tl``, ``tl.tensor``, ``tl.math`` and the tensor
descriptor class with ``inspect.getmembers`` each time. Inside a kernel those modules are
patched already, and a patched builtin is a plain function that the scan skips, so the
second patching changes nothing; but codetta's epilogue programs are many small helpers
called per sub-tile, and on the CPU suite's integration tests the scans took about a third
of the time (cProfile of test_hf_gradient_checkpointing: 19.5 s of 58 s in
``_patch_builtin``, NOTES.md "The CPU suite's time").

``install()`` wraps ``_patch_lang``: a call made while a kernel runs, for a helper whose
module sees only language modules that kernel's launch patched, returns at once; every
other call patches as before (a launch's own patching and restoring unchanged). Nothing
in codetta depends on it: without it (another Triton, or ``CODETTA_TEST_PLAIN_INTERPRETER=1``)
the tests run as they did, slower.
"""

from __future__ import annotations

import os


class _Nothing:
    def restore(self) -> None:
        pass


_NOTHING = _Nothing()  # (what a skipped re-patching returns: its callers ignore it)


class _Launch:
    """A kernel launch's patch scope: restoring it also ends its record of patched modules."""

    def __init__(self, scope, active: list):
        self.scope, self.active = scope, active

    def restore(self) -> None:
        try:
            self.scope.restore()
        finally:
            self.active.pop()


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` (once); False where it is not the expected one."""
    if os.environ.get("CODETTA_TEST_PLAIN_INTERPRETER") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    real = getattr(interpreter, "_patch_lang", None)
    if real is None or getattr(real, "codetta_wrapped", False):
        return False
    if not all(hasattr(interpreter, n) for n in ("_LangPatchScope", "InterpretedFunction", "GridExecutor")):
        return False
    langs = {id(tl): tl, id(tl.core): tl.core}
    seen: dict = {}  # a function -> the language modules its globals name
    active: list = []  # per running launch: the ids of the language modules it patched

    def modules(fn) -> frozenset:
        found = seen.get(fn)
        if found is None:
            found = seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if id(v) in langs)
        return found

    def patch_lang(fn):
        mods = modules(fn)
        if active and mods <= active[-1]:
            return _NOTHING  # a helper inside a running kernel: everything it sees is patched
        scope = real(fn)
        if active:  # a helper naming a module its kernel did not: patched (and kept) as before
            active[-1] = active[-1] | mods
            return scope
        active.append(mods)  # a launch: its scope's restore ends the record
        return _Launch(scope, active)

    patch_lang.codetta_wrapped = True
    interpreter._patch_lang = patch_lang
    return True
