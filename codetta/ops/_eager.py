"""Eager calls of the operators without torch.library's per-call dispatch.

Each operator is a ``torch.library.custom_op`` so that torch.compile can trace it
(with its fake implementation and ``register_autograd``). In eager mode that costs
host time: on this project's CPU machine a custom op with autograd took ~200 us per
forward call against ~30 us for a ``torch.autograd.Function`` over the same function
(PyTorch issue #176592 reports the same gap), and a Llama-3.2-1B training step makes
~67 such calls, where the host can set the step's pace (FSDP2 on two GPUs, NOTES.md).

``FastOp`` calls the plain implementation, through one ``autograd.Function`` that
reuses the op's own ``setup_context`` and backward, when nothing needs the custom op:
not while torch.compile traces, no torch function or dispatch mode active, no
functorch transform, every tensor argument a plain tensor (not a DTensor, a fake or
another subclass). Otherwise it calls the custom op. Arguments and results may hold
lists of tensors one level deep (the operators' schemas).

``derived`` keeps a small table made from a long-lived tensor (RoPE's frequency tables
from a model's inv_freq buffer) with that tensor, under the same conditions.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..kernels.persistent import kept
from ..kernels.settings import SETTINGS

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
# argument types that are never tensors: skipped without an isinstance test (the
# operators' ~20 arguments a call, most of them these)
_NOT_TENSORS = frozenset((float, int, bool, str, type(None)))


def _tracing() -> bool:
    """torch.compile tracing, a dispatch or torch function mode, or a functorch transform."""
    return (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
    )


def refuse_nonzero(t: torch.Tensor, message: str) -> None:
    """Raises ``message`` unless every entry of ``t`` is zero: a gradient that reached an
    output whose gradient is not formed, where only zeros may come (AOTAutograd forms a
    tangent of zeros for an output that requires a gradient and gets none: a compiled
    graph that ends between that output and the operator that reads it). At once in eager
    mode (one read of ``t`` and a synchronization, on a path taken only when a gradient
    arrives at all); while a backward is traced, as an asynchronous device assertion (no
    data-dependent branch; on a GPU a failed one ends the process). Traced is judged by the
    tensor's type and the dispatch modes too: torch 2.11 does not report AOTAutograd's trace
    of a backward as compiling, and a host read there failed the graph's compile, which
    Dynamo then ran uncompiled."""
    if _tracing() or type(t) not in _PLAIN:
        torch._assert_async(torch.logical_not(t.any()), message)
    elif bool(t.any()):
        raise RuntimeError(message)


def _eager_ok(args) -> bool:
    if _tracing():
        return False
    for a in args:
        kind = type(a)
        if kind in _PLAIN or kind in _NOT_TENSORS:
            continue
        if kind is list or kind is tuple:
            for t in a:
                if type(t) not in _PLAIN and isinstance(t, torch.Tensor):
                    return False
        elif isinstance(a, torch.Tensor):
            return False
    return True


def _flatten(values) -> tuple[list, tuple]:
    """Values with lists one level deep -> (flat items, each value's list length or None)."""
    flat, lens = [], []
    for v in values:
        if isinstance(v, (list, tuple)):
            flat.extend(v)
            lens.append(len(v))
        else:
            flat.append(v)
            lens.append(None)
    return flat, tuple(lens)


def _unflatten(flat, lens) -> list:
    out, i = [], 0
    for n in lens:
        if n is None:
            out.append(flat[i])
            i += 1
        else:
            out.append(list(flat[i : i + n]))
            i += n
    return out


class _Call(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, in_lens, box, *flat):
        args = tuple(_unflatten(flat, in_lens))
        out = op.fn(*args)
        op.setup_context(ctx, args, out)
        flat_out, box[0] = _flatten(out)
        ctx.op, ctx.in_lens, ctx.out_lens = op, in_lens, box[0]
        return tuple(flat_out)

    @staticmethod
    def backward(ctx, *flat_grads):
        if torch.is_grad_enabled():  # (in a backward: create_graph=True)
            raise RuntimeError(
                "codetta's operators have no double backward: a backward with create_graph=True (a "
                "gradient penalty, a Hessian-vector product) through them is not supported"
            )
        grads = ctx.op.backward(ctx, *_unflatten(flat_grads, ctx.out_lens))
        ctx.codetta_backward_ran = True  # (a later error at unpacking: a second backward)
        flat = []
        for g, n in zip(grads, ctx.in_lens):
            if n is None:
                flat.append(g)
            else:
                flat.extend([None] * n if g is None else g)
        return (None, None, None, *flat)


class FastOp:
    """``op``: a custom op (``CustomOpDef``); ``fn``: the plain function it was made from;
    ``setup_context`` / ``backward``: what was given to its ``register_autograd`` (None
    for an op without autograd, e.g. a backward op). ``FastOp(...)(*args)`` returns
    what ``op(*args)`` would (lists as lists), the same gradients included."""

    def __init__(self, op, fn, setup_context=None, backward=None):
        self.op, self.fn, self.setup_context, self.backward = op, fn, setup_context, backward

    def __call__(self, *args):
        if not _eager_ok(args):
            return self.op(*args)
        if not torch.is_grad_enabled():
            return self.fn(*args)
        if self.backward is None:
            # an op without autograd (a backward op) under grad mode with inputs that need
            # gradients (a double backward): the custom op says it has no derivative
            flat, _ = _flatten(args)
            needs = any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
            return self.op(*args) if needs else self.fn(*args)
        flat, lens = _flatten(args)
        box = [None]
        out = _Call.apply(self, lens, box, *flat)
        return tuple(_unflatten(out, box[0]))


# Tables derived from a tensor that stays the same call after call (a model's RoPE
# inv_freq buffer): made once per source tensor and version, not per call (each made
# table is a kernel launch and ~70-80 us of host time on the H200 machine, NOTES.md).
# Keyed by the source's id, each entry holding a weak reference to it (checked on every
# hit, so a new tensor at a dead one's address never gets its tables) whose callback
# drops the entry when the source dies.
_DERIVED: dict = {}


def _forget(key: int, ref, table: dict = _DERIVED) -> None:
    # (the table bound when defined: at interpreter exit the module's globals may already
    # be None when a source dies, "Exception ignored in ... _forget")
    entry = table.get(key)
    if entry is not None and entry[0] is ref:
        del table[key]


def derived(src: torch.Tensor, key, make) -> torch.Tensor:
    """``make()``, a table derived from ``src`` alone, kept with ``src`` (weakly, keyed by
    ``key``, ``src``'s version counter and its storage address, so an in-place change of
    ``src`` or a new ``.data`` remakes it; a change made through ``src.data`` in place
    bumps no counter and is not seen: change such a tensor in place under
    ``torch.no_grad()``, as Hugging Face's rotary embeddings do);
    made afresh while tracing, under a dispatch mode, for a tensor subclass, a tensor
    that requires grad or an inference tensor (no version counter). A kept table is made
    outside any CUDA graph's memory pool; one not yet made when a CUDA stream capture
    asks for it is made for that graph and not kept (its tensors hold nothing until the
    graph replays; ``kernels/persistent.py``)."""
    if type(src) not in _PLAIN or _tracing() or src.requires_grad or src.is_inference():
        return make()  # (tracing: checked before the tensor's fields)
    tables = derived_tables(src)
    if tables is None:
        ident = id(src)
        ref = weakref.ref(src, lambda r, ident=ident, forget=_forget: forget(ident, r))
        tables = {}
        _DERIVED[ident] = (ref, src._version, tables, src.data_ptr())
    return kept(tables, key, make, src.device)  # (a table made before serves a capture too)


def derived_tables(src: torch.Tensor) -> dict | None:
    """The tables kept with ``src`` for its current version (by key), or None."""
    entry = _DERIVED.get(id(src))
    if entry is None or entry[0]() is not src or entry[1] != src._version or entry[3] != src.data_ptr():
        return None
    return entry[2]


def saved_tensors(ctx, op: str) -> tuple:
    """``ctx.saved_tensors``, with autograd's in-place error on a second backward through
    the same graph (``retain_graph=True``) said in codetta's terms: a SwiGLU's backward
    writes dg and du over its saved g and u (``CODETTA_OVERWRITE_SAVED=1``, the default;
    ops/swiglu.py), so a second pass would read gradients as activations and autograd
    refuses it."""
    try:
        return ctx.saved_tensors
    except RuntimeError as exc:
        # (before any backward ran, or with the setting off, the change was the caller's:
        # autograd's own message names the tensor)
        ran = getattr(ctx, "codetta_backward_ran", False)
        if "modified by an inplace operation" not in str(exc) or not ran or not SETTINGS.overwrite_saved:
            raise
        raise RuntimeError(
            f"codetta ({op}): a second backward through the same graph (retain_graph=True) is not "
            "supported by default: the first one wrote the SwiGLU gradients over the saved gate and up "
            "activations (CODETTA_OVERWRITE_SAVED=1, as Liger does: two [tokens, f] tensors less). "
            "Set CODETTA_OVERWRITE_SAVED=0 (and, for an untied LM head, CODETTA_CE_FINISH=0) to "
            "backward twice"
        ) from exc
