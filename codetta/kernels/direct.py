"""Launching an already compiled kernel again without ``JITFunction.run``'s per-call work.

A Triton launch through ``kernel[grid](...)`` binds every argument, computes its
specialization key, looks the compiled kernel up and checks the globals it used:
~20-40 us of Python per launch, several times what the driver's launch costs. A
call site that has launched a kernel once, and knows that its next launches
specialize the same way (same integer values, same dtypes, same pointer
alignment: the caller's key must say so), keeps the compiled kernel and hands the
driver's launcher its arguments directly.

Only for CUDA launches with no Triton launch hooks installed (a profiler's hooks
need the full path); ``usable()`` says so per launch.
"""

from __future__ import annotations

import torch
from triton import knobs


def _empty(hook) -> bool:
    # Triton 3.6 keeps hooks in a HookChain (its ``calls`` list), older ones a bare callable
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def usable() -> bool:
    """False while Triton launch hooks are installed (a profiler): launch the full way then."""
    rt = knobs.runtime
    return _empty(rt.launch_enter_hook) and _empty(rt.launch_exit_hook)


def raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device, as the driver's launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


class DirectKernel:
    """A compiled kernel with its grid and constexpr arguments fixed.

    ``jit_fn`` is the ``@triton.jit`` / ``@gluon.jit`` function ``compiled`` came from;
    a launch passes the ``n_positional`` leading arguments (``None`` for an unused
    constexpr slot, as the JIT call did); every later parameter must be in ``consts``.
    """

    __slots__ = ("_launch", "_function", "_meta", "_tail", "grid")

    def __init__(self, jit_fn, compiled, n_positional: int, consts: dict, grid: int):
        names = jit_fn.arg_names
        rest = names[n_positional:]
        missing = [n for n in rest if n not in consts]
        if missing:
            raise ValueError(f"{jit_fn.__name__}: no value for parameter(s) {missing} of a direct launch")
        self._tail = tuple(consts[n] for n in rest)
        compiled._init_handles()
        self._launch = compiled.run
        self._function = compiled.function
        self._meta = compiled.packed_metadata
        self.grid = grid

    def __call__(self, stream: int, *args) -> None:
        self._launch(
            self.grid, 1, 1, stream, self._function, self._meta, None, None, None, *args, *self._tail
        )
