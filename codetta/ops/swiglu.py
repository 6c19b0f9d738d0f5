"""The SwiGLU MLP as GEMM epilogues (docs/design.md, the MLP block), forward and backward.

    g = x @ W_gate^T,  u = x @ W_up^T,  y = silu(g) * u,  out = [residual +] y @ W_down^T

Forward: one GEMM multiplies x by both weights (used as they are: two [f, d]
tensors, or the two halves of one fused [2f, d] tensor; no copy) and its epilogue
stores g, u and y (SWIGLU); the down GEMM adds the residual in its epilogue
(ACCUMULATE seeded by it). Backward, given d_out: the down projection's dX GEMM
forms dg and du in its epilogue (DSWIGLU: dy is never written), then
dx = dg @ W_gate + du @ W_up (one GEMM over both: K parts, rounded once),
dW_gate = dg^T x, dW_up = du^T x, dW_down = d_out^T y.

Saved for the backward: g, u and y (eager PyTorch keeps g, silu(g), u and y), or g and
u alone (``CODETTA_SWIGLU_KEEP_Y=0``, and by default at model widths d >= 4096:
``Settings.keeps_y``): the dX epilogue then forms y again from them (DSWIGLU_Y) for
dW_down, an [M, f] activation less for an [M, f] write more. In eager
mode the dSwiGLU epilogue writes dg and du over g and u (each element read, then written,
by the same tile; nothing else holds them): the backward's peak has two [M, f] tensors
fewer. Their version counters are bumped, so a second backward through the same graph
(``retain_graph=True``) raises (autograd's in-place error, naming the setting that allows
it: ``_eager.saved_tensors``) instead of reading gradients as activations. Registered
as torch.library custom ops, so torch.compile(fullgraph=True) traces them (the traced
backward writes new tensors: its schema mutates nothing).
"""

from __future__ import annotations

import torch

from ..kernels.launch import gemm
from ..kernels.operands import check_gemm_dtype, check_same_device, check_tensor
from ..kernels.settings import SETTINGS
from ..programs import ACCUMULATE, DSWIGLU, DSWIGLU_Y, STORE_K2, SWIGLU
from ._eager import FastOp, saved_tensors
from .norm_checks import check_layouts


def _forward_impl(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None,
    keep_y: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # keep_y: whether the backward gets y (``Settings.keeps_y``, decided by the caller: an
    # argument, so a traced graph records it and torch.compile's caches tell the two apart)
    # returns (out, g, u, y): g, u, y are kept for the backward
    act = gemm(x, w_gate, epilogue=SWIGLU, up=w_up)
    if residual is None:
        out = gemm(act.y, w_down)
    else:
        out = gemm(act.y, w_down, epilogue=ACCUMULATE, c=residual)
    return out, act.g, act.u, act.y


_forward = torch.library.custom_op("codetta::swiglu_mlp", mutates_args=())(_forward_impl)


@_forward.register_fake
def _(x, w_gate, w_up, w_down, residual, keep_y):
    M, f = x.shape[0], w_gate.shape[0]
    return x.new_empty((M, w_down.shape[0])), *(x.new_empty((M, f)) for _ in range(3))


def _backward_impl(
    dout: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    y: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # returns (dx, dW_gate, dW_up, dW_down); y None: not kept, formed again from g and u
    return _backward_body(dout, x, w_gate, w_up, w_down, g, u, y, False)


def _backward_over_saved(dout, x, w_gate, w_up, w_down, g, u, y):
    """The eager backward: dg and du written over the saved g and u (their last reader;
    ``CODETTA_OVERWRITE_SAVED=0``: into new tensors)."""
    return _backward_body(dout, x, w_gate, w_up, w_down, g, u, y, SETTINGS.overwrite_saved)


def _backward_body(dout, x, w_gate, w_up, w_down, g, u, y, overwrite):
    dg, du, formed = dswiglu_dx(dout, w_down.t(), g, u, y is None, overwrite)
    dw_down = gemm(dout.t(), (y if formed is None else formed).t())
    dx = gemm(dg, w_gate.t(), epilogue=STORE_K2, a1=du, w1=w_up.t())  # dg W_gate + du W_up, one launch
    return dx, gemm(dg.t(), x.t()), gemm(du.t(), x.t()), dw_down


def dswiglu_dx(dout, w_down_t, g, u, form_y: bool, overwrite: bool):
    """The down projection's dX GEMM with the dSwiGLU epilogue: (dg, du, y formed again
    from g and u when ``form_y`` (DSWIGLU_Y: the forward did not keep y), else None).
    ``overwrite``: dg and du written over g and u (their last reader), whose version
    counters are then bumped, so autograd refuses a later read of them (a second backward
    through the graph) instead of handing out gradients as activations. Both SwiGLU
    backwards call it: ``swiglu_mlp``'s and ``residual_rmsnorm_linear``'s with a SwiGLU y."""
    over = (g, u) if overwrite else None
    if form_y:
        dg, du, y = gemm(
            dout, w_down_t, epilogue=DSWIGLU_Y, g=g, u=u, out=None if over is None else (*over, None)
        )
    else:
        (dg, du), y = gemm(dout, w_down_t, epilogue=DSWIGLU, g=g, u=u, out=over), None
    if overwrite:
        torch.autograd.graph.increment_version(g)
        torch.autograd.graph.increment_version(u)
    return dg, du, y


_backward = torch.library.custom_op("codetta::swiglu_mlp_backward", mutates_args=())(_backward_impl)


@_backward.register_fake
def _(dout, x, w_gate, w_up, w_down, g, u, y):
    return x.new_empty(x.shape), w_gate.new_empty(w_gate.shape), w_up.new_empty(w_up.shape), \
        w_down.new_empty(w_down.shape)  # fmt: skip


def _setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, residual, keep_y = inputs
    _, g, u, y = output
    ctx.has_residual = residual is not None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w_gate, w_up, w_down, g, u, y if keep_y else None)


def _autograd_backward(ctx, dout, dg, du, dy):
    # g, u and y are internal outputs (the public function returns only out): no gradient
    x, w_gate, w_up, w_down, g, u, y = saved_tensors(ctx, "swiglu_mlp")
    if dout is None:
        return None, None, None, None, None, None
    dout = dout.contiguous()
    dx, dw_gate, dw_up, dw_down = _backward_fast(dout, x, w_gate, w_up, w_down, g, u, y)
    return dx, dw_gate, dw_up, dw_down, dout if ctx.has_residual else None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)
# eager calls skip torch.library's dispatch (ops/_eager.py); torch.compile traces the custom ops
_forward_fast = FastOp(_forward, _forward_impl, _setup_context, _autograd_backward)
_backward_fast = FastOp(_backward, _backward_over_saved)


def _split_gate_up(w_gate, w_up):
    """(W_gate, W_up) from two tensors, or from one fused [2f, d] tensor (w_up None):
    its halves, as views."""
    check_tensor("w_gate" if w_up is not None else "w_gate_up", w_gate)
    if w_up is not None:
        return w_gate, w_up, ("w_gate", "w_up")
    if w_gate.dim() != 2 or w_gate.shape[0] % 2:
        raise ValueError(
            f"a fused w_gate_up (w_up=None) must be 2-D [2f, d] with an even first dimension, "
            f"got {tuple(w_gate.shape)}"
        )
    f = w_gate.shape[0] // 2
    return w_gate[:f], w_gate[f:], ("w_gate_up[:f]", "w_gate_up[f:]")


def swiglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[residual +] (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``: a Llama-family MLP.

    x [..., d]; w_gate, w_up [f, d] (Hugging Face's ``gate_proj.weight`` and
    ``up_proj.weight``), or one fused [2f, d] tensor as ``w_gate`` with ``w_up=None``
    (gate rows first); w_down [d, f]; residual [..., d] or None. Differentiable in
    every tensor. bf16/fp16 on the GPU (fp32 too on CPU); d and f multiples of 8.
    """
    w_gate, w_up, (gate_name, up_name) = _split_gate_up(w_gate, w_up)
    named = {"x": x, gate_name: w_gate, up_name: w_up, "w_down": w_down}
    if residual is not None:
        named["residual"] = residual
    for name, t in named.items():
        check_tensor(name, t)
    check_same_device(named)
    for name, t in named.items():
        check_gemm_dtype(name, t, on_gpu_too=False)
        if t.dtype != x.dtype:
            raise TypeError(f"{name} ({t.dtype}) must have x's dtype ({x.dtype})")
    check_gemm_dtype("x", x)
    for name in (gate_name, up_name, "w_down"):
        if named[name].dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(named[name].shape)}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its features)")
    d, f = x.shape[-1], w_gate.shape[0]
    if w_gate.shape != (f, d):
        raise ValueError(f"{gate_name} must be [f, d={d}] (x has {d} features), got {tuple(w_gate.shape)}")
    if w_up.shape != (f, d):
        raise ValueError(f"{up_name} must be [f={f}, d={d}] like {gate_name}, got {tuple(w_up.shape)}")
    if w_down.shape != (d, f):
        raise ValueError(f"w_down must be [d={d}, f={f}], got {tuple(w_down.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    # (x and the residual are made contiguous where they are not: only their start matters)
    layouts = {gate_name: w_gate, up_name: w_up, "w_down": w_down}
    layouts.update(
        {n: t for n, t in (("x", x), ("residual", residual)) if t is not None and t.is_contiguous()}
    )
    check_layouts(layouts, alike=(gate_name, up_name))
    unit = 16 // x.element_size()
    for what, size in (("the hidden size d", d), ("the intermediate size f", f)):
        if size % unit:
            raise ValueError(
                f"{what} = {size} must be a multiple of {unit} for {x.dtype} "
                "(TMA moves rows in 16-byte units)"
            )
    lead = x.shape[:-1]
    out, _, _, _ = _forward_fast(
        x.reshape(-1, d).contiguous(), w_gate, w_up, w_down,
        None if residual is None else residual.reshape(-1, d).contiguous(), SETTINGS.keeps_y(d),
    )  # fmt: skip
    return out.reshape(*lead, d)
