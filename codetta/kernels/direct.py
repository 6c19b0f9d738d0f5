"""Launching an already compiled kernel again without ``JITFunction.run``'s per-call work.

A Triton launch through ``kernel[grid](...)`` binds every argument, computes its
specialization key, looks the compiled kernel up and checks the globals it used:
per launch on the H200 machine's host (run 166, NOTES.md) ~5 us for a row pass's ten
arguments, far more for a GEMM's forty-odd (a GEMM call 110 us through it, 22 bound). A
call site that has launched a kernel once, and knows that its next launches
specialize the same way (same integer values, same dtypes, same pointer
alignment: the caller's key must say so), keeps the compiled kernel and hands the
driver's launcher its arguments directly.

Only for CUDA launches with no Triton launch hooks installed (a profiler's hooks
need the full path); ``usable()`` says so per launch.
"""

from __future__ import annotations

import torch
import triton
from triton import knobs

from .device import triton_mismatch
from .memo import Memo


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
    constexpr slot, as the JIT call did); every later parameter must be in ``consts`` or
    have a default. ``grid``: programs along x, or a tuple of up to three dimensions.

    Host TMA descriptors among the arguments are encoded once per base address (and
    shape, strides): Triton's launcher encodes each on every launch (a driver call and
    its Python, several descriptors a GEMM). A descriptor is its tensor's address and
    layout alone, so one encoded for the same address and layout is the same.
    """

    __slots__ = ("_launch", "_function", "_meta", "_tail", "_grid", "_raw", "_descs", "_flags", "compiled")

    def __init__(self, jit_fn, compiled, n_positional: int, consts: dict, grid):
        rest = jit_fn.params[n_positional:]
        missing = [p.name for p in rest if p.name not in consts and not p.has_default]
        if missing:
            raise ValueError(f"{jit_fn.__name__}: no value for parameter(s) {missing} of a direct launch")
        self._tail = tuple(consts[p.name] if p.name in consts else p.default for p in rest)
        compiled._init_handles()
        self.compiled = compiled
        self._launch = compiled.run
        self._function = compiled.function
        self._meta = compiled.packed_metadata
        self._grid = (*grid, 1, 1)[:3] if isinstance(grid, tuple) else (grid, 1, 1)
        self._raw = self._descs = self._flags = None
        unwrapped = _unwrap_descriptors(compiled.run)
        if unwrapped is not None and all(i < n_positional for i in unwrapped[1]):
            raw, positions, metas, flags = unwrapped
            self._raw, self._flags = raw, flags
            self._descs = {i: (m, {}) for i, m in zip(sorted(positions), metas)}

    def __call__(self, stream: int, *args) -> None:
        if self._raw is None:
            g = self._grid
            self._launch(*g, stream, self._function, self._meta, None, None, None, *args, *self._tail)
            return
        final = [*self._grid, stream, self._function, *self._flags, self._meta, None, None, None]
        descs = self._descs
        for i, a in enumerate(args):
            if i in descs:
                final.extend(_encoded(a, *descs[i]))
            else:
                final.append(a)
        self._raw(*final, *self._tail)


_MAX_ENCODED = 64  # encoded descriptors kept per descriptor argument of a bound kernel


def _encoded(desc, meta, cache: dict) -> list:
    """The launcher's arguments for one host descriptor: Triton's own encoding, kept per
    base address with the shape and strides it was made for."""
    ptr = desc.base.data_ptr()
    hit = cache.get(ptr)
    mode = (desc.padding, getattr(desc, "round_f32_to_tf32", False))  # (the second: Triton 3.7 on)
    if hit is not None and hit[0] == desc.shape and hit[1] == desc.strides and hit[2] == mode:
        return hit[3]
    from triton.backends.nvidia.driver import make_tensordesc_arg

    encoded = make_tensordesc_arg(desc, meta)
    if len(cache) >= _MAX_ENCODED:
        cache.clear()
    cache[ptr] = (desc.shape, desc.strides, mode, encoded)
    return encoded


# Triton 3.6's C launcher takes the kernel's arguments flat after (grid, stream, function,
# cooperative grid, PDL, scratch, metadata, hooks); 3.7 and 3.8 add arguments before them and
# take them as one list. The descriptor path hands them on in 3.6's layout only (the layout the
# GPU runs verified: the tested series, device.py); under another Triton a bound kernel
# launches through Triton's launcher.
_RAW_LAYOUT = triton_mismatch(triton.__version__) is None


def _unwrap_descriptors(launcher):
    """(the C launcher, positions of the descriptor parameters, their metadata, the
    cooperative-grid / PDL / scratch arguments) of a Triton 3.6 CUDA launcher whose
    descriptors its Python wrapper encodes; None where that is not the layout found (another
    Triton, a kernel with no descriptors, one that needs scratch memory allocated per
    launch): the launch then takes Triton's own path."""
    if not _RAW_LAYOUT:
        return None
    fn = getattr(launcher, "launch", None)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or getattr(launcher, "global_scratch_size", 1) or \
            getattr(launcher, "profile_scratch_size", 1):  # fmt: skip
        return None
    env = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    raw, positions, metas = env.get("launcher"), env.get("tensordesc_indices"), env.get("tensordesc_meta")
    if raw is None or not positions or not metas or len(metas) != len(positions) or None in metas:
        return None
    flags = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)
    return raw, frozenset(positions), list(metas), flags


# -- any ``kernel[grid](...)`` launch, bound by its arguments' specialization ----------------

_JIT = Memo()  # distinct launch signatures remembered (forgotten all at once past its limit)


def _spec(v):
    """What a launch specializes on in one argument, or finer: a tensor's dtype and 16-byte
    alignment, any other value itself (an int's value sets its type and divisibility)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    return type(v), v


def launch_jit(jit_fn, grid, args: tuple, kwargs: dict):
    """``jit_fn[grid](*args, **kwargs)`` on CUDA, returning the compiled kernel; a call whose
    launch signature (the kernel, grid, current device, each argument's ``_spec`` and the
    keyword arguments' values) was seen before skips Triton's binding, specialization and
    cache lookup (~5 us of a row pass's ~25 us of host time on the H200 machine, run 166)."""
    if not usable() or not isinstance(grid, tuple):
        return jit_fn[grid](*args, **kwargs)
    dev = torch._C._cuda_getDevice()
    try:
        key = (jit_fn, grid, dev, *map(_spec, args), *kwargs.items())
        bound = _JIT.get(key)
    except TypeError:  # an unhashable argument: the full path
        return jit_fn[grid](*args, **kwargs)
    if bound is not None:
        bound(torch._C._cuda_getCurrentRawStream(dev), *args)
        return bound.compiled
    compiled = jit_fn[grid](*args, **kwargs)
    tensor_kwarg = any(isinstance(v, torch.Tensor) for v in kwargs.values())  # (would be fixed, and kept)
    if compiled is not None and hasattr(compiled, "packed_metadata") and not tensor_kwarg:
        _JIT[key] = DirectKernel(jit_fn, compiled, len(args), kwargs, grid)
    return compiled
