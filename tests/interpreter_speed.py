"""Skip the Triton interpreter's redundant re-patching of ``triton.language`` (CPU tests only),
and four more of its costs that change no result (``_cache_np_dtypes``,
``_lazy_tuple_type_names``, ``_lazy_tuple_types``, ``_no_overflow_sanitizer``: their
docstrings).

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

import dataclasses
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
    _cache_np_dtypes(interpreter, tl)
    _lazy_tuple_type_names(tl.core)
    _lazy_tuple_types(tl.core)
    _no_overflow_sanitizer(interpreter)
    return True


def _cache_np_dtypes(interpreter, tl) -> None:
    """``interpreter._get_np_dtype`` from a table made once: Triton 3.6 builds a dict of 19
    numpy dtypes on every call, ~720k calls and ~8 % of test_residual_rmsnorm's time under
    cProfile. The table is the function's own answers; any other type goes to it."""
    real = getattr(interpreter, "_get_np_dtype", None)
    if real is None or getattr(real, "codetta_wrapped", False):
        return
    names = ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
             "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8",
             "float8e4b15")  # fmt: skip
    table = {}
    for name in names:
        t = getattr(tl, name, None)
        if t is not None:
            table[t] = real(t)
    pointer = real(tl.pointer_type(tl.float32))
    block, pointer_type = tl.block_type, tl.pointer_type

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer_type):
            return pointer
        found = table.get(tt_dtype)
        return found if found is not None else real(tt_dtype)

    get_np_dtype.codetta_wrapped = True
    interpreter._get_np_dtype = get_np_dtype


def _lazy_tuple_type_names(core) -> None:
    """``tuple_type.name`` formed when read instead of in ``__init__``: every ``tl.tensor`` the
    interpreter makes builds a ``tl.tuple`` of its shape, whose type formatted its name
    string at once (~4.3M times, ~17 % of test_residual_rmsnorm's time under cProfile, with
    the tuple types' other work); the name is read only to print or mangle a type. The same
    string when read: only ``__init__`` ever set it, from ``types`` and ``fields``, which
    nothing changes afterwards."""
    cls = getattr(core, "tuple_type", None)
    if cls is None or getattr(cls, "codetta_lazy_name", False) or "name" in vars(cls):
        return

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    def name(self) -> str:
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"

    cls.__init__ = __init__
    cls.name = property(name)
    cls.codetta_lazy_name = True


def _lazy_tuple_types(core) -> None:
    """A ``tl.tuple``'s type (``_type_for_tuple_values``: a ``tuple_type`` of each value's
    type) formed when first read instead of in ``__init__``: every ``tl.tensor`` holds its
    shape as a ``tl.tuple``, whose type the interpreter mostly never reads (~12 % of the
    float16 norm-range tests' time after the patches above). The same type when read: it is
    formed from ``values``, which only ``_setitem`` changes, and that sets the type anew."""
    cls = getattr(core, "tuple", None)
    tuple_type = getattr(core, "tuple_type", None)
    make = getattr(core, "_type_for_tuple_values", None)
    if None in (cls, tuple_type, make) or getattr(cls, "codetta_lazy_type", False) or "type" in vars(cls):
        return

    def __init__(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, tuple_type):
            self._codetta_type = type
        elif type is not None:  # (a list or tuple of types, as Triton's own __init__ takes)
            self._codetta_type = tuple_type(type)
        else:
            self._codetta_type = None

    def get_type(self):
        found = self.__dict__.get("_codetta_type")
        if found is None:  # (a tuple made before the patch keeps the type it was given)
            found = self.__dict__.get("type") or make(self.values)
            self.__dict__["_codetta_type"] = found
        return found

    def set_type(self, value):
        self.__dict__["_codetta_type"] = value

    cls.__init__ = __init__
    cls.type = property(get_type, set_type)
    cls.codetta_lazy_type = True


def _no_overflow_sanitizer(interpreter) -> None:
    """The interpreter's integer overflow sanitizer off (``InterpreterOptions.sanitize_overflow``,
    on by default in Triton 3.6): every 8-32-bit integer add, subtract and multiply was
    formed again in int64 and compared with the type's limits (~40 % of
    test_residual_rmsnorm's float16 norm-range tests under cProfile), for a
    ``device_assert`` that Triton drops without debug mode, which the interpreter's options
    never turn on (``InterpreterOptions.debug`` False): the work checked nothing."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)  # (a frozen dataclass)
