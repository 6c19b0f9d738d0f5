"""Argument checks of the residual + RMSNorm operators (errors name the argument)."""

from __future__ import annotations

import math

import torch

from ..kernels.memo import Memo, MemoSet
from ..kernels.operands import address, check_dtype, check_gemm_dtype, check_same_device, check_tensor


def mixed(residual: torch.Tensor, y: torch.Tensor) -> bool:
    """A float32 residual stream over bf16/fp16 GEMMs (mixed precision: autocast keeps the
    stream in float32): x and its gradient in float32, the GEMMs' operands in y's dtype."""
    return residual.dtype == torch.float32 and y.dtype in (torch.bfloat16, torch.float16)


def weights_of(weight) -> tuple[list, list[str]]:
    """The next GEMM's weight(s) as a list, with the names errors use."""
    if isinstance(weight, (list, tuple)):
        if not weight:
            raise ValueError("weight: an empty sequence (give one [N, d] tensor or several)")
        return list(weight), [f"weight[{i}]" for i in range(len(weight))]
    return [weight], ["weight"]


def finite_nonnegative(v) -> bool:
    """``v`` a finite number >= 0, judged by comparisons: under torch.compile(dynamic=True)
    a float argument is traced as a symbolic float, on which math.isfinite breaks the graph
    (NaN fails the comparisons too)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < math.inf


_CHECKED = Memo(1024)  # the metadata of argument sets found valid -> their eps


def _meta(t) -> tuple:
    # (strides too: the layout checks read them; check_args adds the 16-byte alignment)
    return type(t), t.shape, t.dtype, t.device, t.stride()


def _aligned(t, name: str) -> bool:
    """Data on a 16-byte boundary (while torch.compile traces, a fake tensor has no address:
    the kernel's own check sees the real one)."""
    return torch.compiler.is_compiling() or not t.numel() or address(name, t) % 16 == 0


def check_layouts(named: dict, alike: tuple = (), vectors: tuple = ()) -> None:
    """The matrices of ``named`` (a GEMM reads them as they are) each contiguous or a
    transposed view of a contiguous tensor, and their data on a 16-byte boundary,
    those named in ``alike`` laid out alike (the GEMM reads them as parts of one operand);
    the vectors named in ``vectors`` contiguous. Errors name the caller's argument."""
    for name, t in named.items():
        if name in vectors:
            if not t.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous, got strides {tuple(t.stride())}; call .contiguous()"
                )
            continue
        if t.numel() and not (t.is_contiguous() or t.t().is_contiguous()):
            raise ValueError(
                f"{name} must be contiguous or a transposed view of a contiguous tensor (no gaps "
                f"between its rows), got shape {tuple(t.shape)} with strides {tuple(t.stride())}; "
                "call .contiguous()"
            )
        if not _aligned(t, name):
            raise ValueError(
                f"{name}'s data must start on a 16-byte boundary (a slice at an odd offset); call .clone()"
            )
    kinds = {name: named[name].is_contiguous() for name in alike if named[name].numel()}
    if len(set(kinds.values())) > 1:
        odd = [n for n, c in kinds.items() if not c]
        raise ValueError(
            f"{', '.join(kinds)} must be laid out alike (each contiguous or each a transposed view); "
            f"{', '.join(odd)} {'is a transposed view' if len(odd) == 1 else 'are transposed views'}: "
            "call .contiguous()"
        )


def check_args(y, w_o, residual, gamma, weight, eps, names=None) -> tuple[list, float]:
    """Validate the operator's arguments (naming them as the caller does, ``names``: the
    next weights'); return the weights as a list and eps. What is checked depends on the
    tensors' types, shapes, dtypes, devices, strides and 16-byte alignment and on eps
    alone: a set of those found valid before is not checked again (~10 us a call on this
    project's CPU machine)."""
    seq = isinstance(weight, (list, tuple))
    if torch.compiler.is_compiling():
        # traced, the full check (once per compile): a lookup keyed on the shapes would pin
        # the token count to a constant (a recompile per count, an error under mark_dynamic)
        return _check_args(y, w_o, residual, gamma, weight, eps, names)
    try:
        ws = list(weight) if seq else [] if weight is None else [weight]
        tensors = (y, w_o, residual, gamma, *ws)
        key = (type(eps), eps, names, type(weight), *map(_meta, tensors))
        key += tuple(t.data_ptr() % 16 == 0 for t in tensors)
        known = _CHECKED.get(key)
    except (AttributeError, TypeError, RuntimeError):
        # not tensors, unhashable, or without storage (torch.func's wrappers): the full
        # check says what
        known = key = None
    if known is not None:
        return ws, known
    ws, eps = _check_args(y, w_o, residual, gamma, weight, eps, names)
    if key is not None:
        _CHECKED[key] = eps
    return ws, eps


def _check_args(y, w_o, residual, gamma, weight, eps, names=None) -> tuple[list, float]:
    ws, w_names = ([], []) if weight is None else weights_of(weight)
    w_names = list(names) if names else w_names
    named = {"y": y, "w_o": w_o, "residual": residual, "gamma": gamma, **dict(zip(w_names, ws))}
    for name, t in named.items():
        check_tensor(name, t)
    check_same_device(named)
    for name in ("y", "w_o", "residual", *w_names):
        check_gemm_dtype(name, named[name], on_gpu_too=False)
    for name in ("w_o", *w_names):
        if named[name].dtype != y.dtype:
            raise TypeError(f"{name} ({named[name].dtype}) must have y's dtype ({y.dtype})")
    if residual.dtype != y.dtype and not mixed(residual, y):
        raise TypeError(
            f"residual ({residual.dtype}) must have y's dtype ({y.dtype}), or be float32 (a float32 "
            "residual stream over bf16/fp16 GEMMs)"
        )
    check_gemm_dtype("y", y)
    check_dtype("gamma", gamma, (torch.float32, y.dtype), f"float32 or y's dtype ({y.dtype})")
    for name in ("w_o", *w_names):
        if named[name].dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(named[name].shape)}")
    if y.dim() < 1 or y.shape[-1] != w_o.shape[1]:
        raise ValueError(
            f"y has {y.shape[-1] if y.dim() else 0} features but w_o [d, K] expects K={w_o.shape[1]}"
        )
    d = w_o.shape[0]
    if residual.shape[-1] != d:
        raise ValueError(f"residual has {residual.shape[-1]} features but w_o produces d={d} (w_o is [d, K])")
    if y.shape[:-1] != residual.shape[:-1]:
        raise ValueError(f"y {tuple(y.shape)} and residual {tuple(residual.shape)} must share leading dims")
    if gamma.shape != (d,):
        raise ValueError(f"gamma must have shape ({d},), got {tuple(gamma.shape)}")
    for name, w in zip(w_names, ws):
        if w.shape[1] != d:
            raise ValueError(f"{name} must be [N, {d}], got {tuple(w.shape)}")
    # (y and the residual are made contiguous where they are not: only their start matters)
    layouts = {"w_o": w_o, **dict(zip(w_names, ws)), "gamma": gamma}
    layouts.update({n: t for n, t in (("y", y), ("residual", residual)) if t.is_contiguous()})
    check_layouts(layouts, alike=tuple(w_names), vectors=("gamma",))
    unit = 16 // y.element_size()
    sizes = [("y's features K", w_o.shape[1]), ("the hidden size d", d)]
    sizes += [(f"{name}'s N", w.shape[0]) for name, w in zip(w_names, ws)]
    for what, size in sizes:
        if size % unit:
            raise ValueError(
                f"{what} = {size} must be a multiple of {unit} for {y.dtype} "
                "(TMA moves rows in 16-byte units)"
            )
    eps = torch.finfo(y.dtype).eps if eps is None else eps
    if not finite_nonnegative(eps):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return ws, float(eps)


def bias_args(bias, weight, ws: list, y: torch.Tensor) -> list:
    """The next GEMMs' biases as a list, one per weight ([] for none): ``bias`` is None, a
    [N] tensor beside one weight, or a sequence as long as ``weight``'s whose entries are
    [N_i] tensors or None (zeros: that output gets none). Each in float32 or the weights' dtype,
    contiguous, on y's device. Errors name the argument. A set of biases found valid
    before (the same metadata and weights' widths: a bias's address is never checked) is not
    checked again."""
    if bias is None:
        return []
    seq = isinstance(bias, (list, tuple))
    bs = list(bias) if seq else [bias]
    # (while torch.compile traces, no memo: a lookup in it would be guarded on, and the
    # set changing during a compile fails that guard; the traced check runs once a compile)
    known, key = False, None
    if not torch.compiler.is_compiling():
        try:
            key = (seq, isinstance(weight, (list, tuple)), y.dtype, y.device, tuple(w.shape[0] for w in ws),
                   *(None if b is None else _meta(b) for b in bs))  # fmt: skip
            known = key in _BIASES_CHECKED
        except (AttributeError, TypeError):  # not tensors, or unhashable: the full check says what
            key = None
    if not known:
        _check_biases(bias, weight, ws, y)
        if key is not None:
            _BIASES_CHECKED.add(key)
    if all(b is None for b in bs):
        return []
    return [y.new_zeros(w.shape[0]) if b is None else b for b, w in zip(bs, ws)]


_BIASES_CHECKED = MemoSet(1024)


def _check_biases(bias, weight, ws: list, y: torch.Tensor) -> None:
    if weight is None:
        raise ValueError("bias: there is no next weight to add it to")
    seq = isinstance(weight, (list, tuple))
    if seq != isinstance(bias, (list, tuple)):
        raise TypeError(
            "bias must be a sequence as long as weight's (one entry per weight, None for none)"
            if seq
            else f"bias must be one [N] tensor beside one weight, got {type(bias).__name__}"
        )
    bs = list(bias) if seq else [bias]
    if len(bs) != len(ws):
        raise ValueError(f"bias has {len(bs)} entries for {len(ws)} weights")
    for i, (b, w) in enumerate(zip(bs, ws)):
        name = f"bias[{i}]" if seq else "bias"
        if b is None:
            continue
        check_tensor(name, b)
        check_same_device({"y": y, name: b})
        check_dtype(name, b, (torch.float32, y.dtype), f"float32 or the weights' dtype ({y.dtype})")
        if b.shape != (w.shape[0],):
            raise ValueError(f"{name} must have shape ({w.shape[0]},) (its weight's N), got {tuple(b.shape)}")
        check_layouts({name: b}, vectors=(name,))
