"""``precompile(step)``: compile every kernel a step launches, all at once, before its first run.

On a new machine each kernel a training step needs compiles the first time it is
launched, one after another (about 1 s each for a GEMM with its epilogue on an H200's
host), so a model's first step waits for all of them in turn. ``precompile`` runs the
step once with every codetta launch replaced by its compile (deferred by Triton's
asynchronous compile mode), then compiles all of them at once in forked child
processes (``compile_pool.py``: threads gain little, the compiler holds the GIL).
Nothing codetta would launch runs; PyTorch's own kernels between them do, on whatever
the unwritten outputs hold, so the step's results are garbage and its gradients are
dropped. Configurations come from the tuning cache, the shipped table or the shape
rule (never tuned here: a shape that ``CODETTA_AUTOTUNE=1`` would tune is tuned, and
its winner compiled, on its first real call).
"""

from __future__ import annotations

import contextlib

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import device, direct
from .compile_pool import compiling_in_children
from .settings import SETTINGS, override

_ACTIVE = False


def active() -> bool:
    """Whether launches are being compiled, not run (inside ``precompile``)."""
    return _ACTIVE


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` (a signature seen before launched directly,
    ``direct.launch_jit``); inside ``precompile``, its compile alone."""
    if _ACTIVE:
        return kernel.warmup(*args, grid=grid, **kwargs)
    if SETTINGS.direct_launch and not device.interpreting():
        return direct.launch_jit(kernel, grid, args, kwargs)
    return kernel[grid](*args, **kwargs)


def precompile(step, model: torch.nn.Module | None = None, workers: int | None = None) -> int:
    """Compile, concurrently, every kernel that ``step()`` (a callable; typically a
    training forward and backward at the real batch shape) would launch through codetta,
    and return how many compiled. ``step`` runs once without codetta's kernels: pass
    the forward and backward, not the optimizer's step (the gradients are garbage).
    The random-number state is restored afterwards and, if ``model`` is given, its
    gradients are set to None (a step that changed its parameters in place raises).
    ``workers``: child processes compiling at once (default: ``CODETTA_COMPILE_WORKERS``,
    else one per CPU core; 1: none, every compile here one by one). Not
    tested inside ``torch.compile``d code (precompile the eager model). On a
    CPU (the interpreter or the PyTorch references) there is nothing to compile:
    returns 0 without calling ``step``.

    Example::

        codetta.apply_codetta(model)
        codetta.precompile(lambda: model(input_ids=ids, labels=ids).loss.backward(), model)
    """
    global _ACTIVE
    if not callable(step):
        raise TypeError(f"step must be a callable (the forward and backward to compile for), got "
                        f"{type(step).__name__}")  # fmt: skip
    if device.interpreting() or not torch.cuda.is_available():
        return 0
    if _ACTIVE:
        raise RuntimeError("codetta.precompile is already running (it does not nest)")
    versions = [p._version for p in model.parameters()] if model is not None else []
    with compiling_in_children(workers) as mode:
        with override(autotune=False), torch.random.fork_rng(devices=[torch.cuda.current_device()]), \
                no_optimizer_steps():  # fmt: skip
            _ACTIVE = True
            try:
                step()
            finally:
                _ACTIVE = False
        compiling = len(mode.future_kernels)
    # (leaving compiled everything, in child processes first: compile_pool.py; a failed
    # compile raised there). Load each into the GPU now, not at the step's first launch:
    for fk in mode.future_kernels.values():
        kernel = fk.result()
        if kernel is not None:
            kernel._init_handles()
    torch.cuda.synchronize()
    if model is not None:
        model.zero_grad(set_to_none=True)
        if [p._version for p in model.parameters()] != versions:
            raise RuntimeError(
                "codetta.precompile: the step changed the model's parameters in place (an optimizer "
                "step?); it ran on unwritten outputs, so the parameters now hold garbage. Pass only "
                "the forward and backward, and reload the weights"
            )
    return compiling


@contextlib.contextmanager
def no_optimizer_steps():
    """Inside: any ``torch.optim`` optimizer's step raises before it changes a parameter.
    A step in precompile's dry run would train on the garbage gradients of unwritten
    outputs (run 98's benchmark did, with or without a ``model`` to check: NOTES.md)."""

    def refuse(optimizer, args, kwargs):
        raise RuntimeError(
            f"codetta.precompile: the step ran {type(optimizer).__name__}.step(); in precompile's dry "
            "run codetta's kernels do not run, so its gradients are garbage. Pass only the forward "
            "and backward"
        )

    handle = register_optimizer_step_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


__all__ = ["precompile"]
