"""``gemm``: validate, pick a configuration, allocate, launch, finish the reductions.

``gemm(a, weight, epilogue=program, **operands)`` computes ``acc = a @ weight.T``
in fp32 and runs the program on it. ``a`` [M, K] and ``weight`` [N, K] may each
be a transposed view of a contiguous tensor (stride 1 in the first dimension):
the backward products ``dY @ W`` (``gemm(dy, w.t())``) and ``dY^T @ X``
(``gemm(dy.t(), x.t())``) run on the same mainloops that way.

Where it runs: on CUDA the chosen mainloop's kernel; on CPU with
``TRITON_INTERPRET=1`` set before import, the portable mainloop through the
Triton interpreter; on CPU without it (or for bfloat16, whose dot products the
interpreter gets wrong), the program's PyTorch reference.
"""

from __future__ import annotations

import functools
import warnings

import torch

from . import device, reductions
from .configs import Config
from .engines import engine_of
from .operands import GemmCall, make_call
from .program import REDUCTIONS, STORE, Kind, Layout, Program
from .settings import SETTINGS
from .tuning import CHOOSER


def _alloc(shape, dtype, dev):
    if SETTINGS.poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)


def alloc_outputs(call: GemmCall) -> list[torch.Tensor]:
    """The program's outputs as the caller gets them (independent of the config)."""
    M, N = call.M, call.N
    outs = []
    for op in call.program.outputs:
        if op.kind is Kind.TILE:
            outs.append(_alloc((M, N), op.dtype or call.dtype, call.device))
        elif op.kind is Kind.HALF_TILE:
            outs.append(_alloc((M, N // 2), op.dtype or call.dtype, call.device))
        else:
            outs.append(_alloc((N,) if op.kind is Kind.COL_SUM else (M,), torch.float32, call.device))
    return outs


def alloc_workspaces(call: GemmCall, cfg: Config) -> list:
    """Per output, the tensor the kernel writes: the output itself for tiles, the
    partials of this geometry for reductions (None)."""
    lay = Layout(cfg.block_m, cfg.block_n, cfg.sub_n)
    return [
        _alloc(reductions.workspace_shape(op.kind, call.M, call.N, lay), torch.float32, call.device)
        if op.kind in REDUCTIONS else None
        for op in call.program.outputs
    ]  # fmt: skip


def _run(call: GemmCall, cfg: Config, outs: list, ws: list, warmup: bool = False) -> None:
    kernel_outs = [w if w is not None else o for o, w in zip(outs, ws)]
    engine_of(cfg).launch(call, cfg, kernel_outs, warmup)
    if warmup:
        return
    for op, out, w in zip(call.program.outputs, outs, ws):
        if w is not None:
            reductions.finish(op.kind, w, out)


def _prepare_for_tuning(call: GemmCall):
    """``cfg -> fn`` for the tuner: outputs shared by all candidates (programs only write
    them), workspaces per tile geometry (their shapes depend on it). Nothing is
    allocated until the tuner asks (a memoized choice never does)."""
    outs: list = []
    by_geometry: dict = {}

    def prepare(cfg: Config):
        if not outs:
            outs.extend(alloc_outputs(call))
        lay = (cfg.block_m, cfg.block_n, cfg.sub_n)
        if lay not in by_geometry:
            by_geometry[lay] = alloc_workspaces(call, cfg)
        ws = by_geometry[lay]
        return lambda warmup=False: _run(call, cfg, outs, ws, warmup)

    return prepare


def _reference(call: GemmCall, outs: list) -> None:
    prog = call.program
    if prog.reference is None:
        raise NotImplementedError(
            f"program {prog.name!r} has no PyTorch reference, so it cannot run on CPU tensors without "
            "the Triton interpreter: set TRITON_INTERPRET=1 before importing codetta, or give it reference="
        )
    acc = call.a.double() @ call.w.double().t()
    kwargs = {op.name: v for op, v in zip(prog.caller_inputs, call.inputs)}
    seed = next((op.name for op in prog.inputs if op.kind is Kind.SEED), None)
    if seed is not None:
        acc = acc + kwargs[seed].double()
    for op in prog.inputs:
        if op.kind is Kind.DTYPE:
            kwargs[op.name] = call.dtype
    got = prog.reference(acc.float(), **kwargs)
    for op, out in zip(prog.outputs, outs):
        if op.name not in got:
            raise KeyError(
                f"program {prog.name!r}: its reference returned no {op.name!r} (it returned {sorted(got)})"
            )
        out.copy_(got[op.name])


def _uses_reference(call: GemmCall) -> bool:
    if call.device.type != "cpu":
        return False
    if not device.interpreting() or SETTINGS.force_reference:
        return True
    if call.dtype == torch.bfloat16:
        _warn_bf16()
        return True
    return False


@functools.cache
def _warn_bf16() -> None:
    warnings.warn(
        "codetta: the Triton interpreter gets bfloat16 dot products wrong; bfloat16 CPU calls "
        "run the PyTorch reference of each program instead of the kernel",
        stacklevel=4,
    )


def gemm(a: torch.Tensor, weight: torch.Tensor, *, epilogue: Program | None = None, config=None, **operands):
    """``epilogue(a @ weight.T)``: one GEMM with its epilogue program fused.

    Returns the program's single output, or a named tuple of its outputs.
    ``gemm`` itself records no autograd graph: for training use the
    differentiable operators in ``codetta.ops`` / ``codetta.nn``.
    ``config`` (a :class:`codetta.Config`) pins the kernel configuration (and
    so the mainloop) instead of the tuned one.
    """
    call = make_call(epilogue if epilogue is not None else STORE, a, weight, operands)
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a codetta Config, got {type(config).__name__}")
    outs = alloc_outputs(call)
    if call.M > 0:
        if _uses_reference(call):
            _reference(call, outs)
        else:
            cfg = config or CHOOSER.choose(call, _prepare_for_tuning(call))
            _run(call, cfg, outs, alloc_workspaces(call, cfg))
    elif outs:
        for op, out in zip(call.program.outputs, outs):
            if op.kind is Kind.COL_SUM:
                out.zero_()  # a sum over no rows
    if len(outs) == 1:
        return outs[0]
    return call.program.result(*outs)


__all__ = ["gemm"]
