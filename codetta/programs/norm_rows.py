"""The RMSNorm operator's own passes over whole rows (beside its GEMM programs in norm.py):
the rowwise backward, the two-pass backward's finish, zeta = rowsum(dz z) and W * gamma.

Each row pass forms the norm's scale r = rsqrt(sumsq / d + eps) from K1's row
sums, exactly as the GEMM programs do (``norm.rms_scale_of``).
"""

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..kernels import device, precompile
from ..kernels.launch import alloc
from ..kernels.settings import SETTINGS
from .norm import rms_scale_of


def torch_path(x: torch.Tensor, *dtypes: torch.dtype) -> bool:
    """CPU tensors run the row passes (here, ce.py, rope.py) in PyTorch unless the
    interpreter is on, and bf16 ones always (x's dtype, or another the pass reads or
    writes: ``dtypes``): the triton 3.6 interpreter rounds fp32 -> bf16 by truncation
    (twice the error of round-to-nearest)."""
    return x.device.type == "cpu" and (
        not device.interpreting() or SETTINGS.force_reference or torch.bfloat16 in (x.dtype, *dtypes)
    )


def traced(x: torch.Tensor) -> bool:
    """True while ``x`` is being traced (torch.compile, AOT autograd's backward, fake
    tensors): a raw kernel launch would need its data. torch 2.13 reports AOT autograd's
    trace of a custom op's backward as compiling; torch 2.11 does not (run 68), so the
    dispatch mode and the tensor's type are checked too."""
    return (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or type(x) not in (torch.Tensor, torch.nn.Parameter)
    )


def _r(sumsq: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    return torch.rsqrt(sumsq.float() / d + eps)[:, None]


def _check_rows(x, dx_out, **same_as_x):
    """Validate the [M, d] operands of a row pass; return the dx buffer."""
    for name, t in same_as_x.items():
        if t.shape != x.shape or not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous with x's shape {tuple(x.shape)}, got {tuple(t.shape)}"
            )
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if dx_out is None:
        return torch.empty_like(x)
    if dx_out.shape != x.shape or dx_out.dtype != x.dtype or not dx_out.is_contiguous():
        raise ValueError(f"dx_out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    return dx_out


@triton.jit
def _rowdot_kernel(a_ptr, b_ptr, out_ptr, N, stride_a, stride_b, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [M] = sum over columns of a * b (a, b [M, N], rows contiguous), summed in fp32."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"rowdot needs two [M, N] tensors, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("rowdot needs row-contiguous inputs")
    M, N = a.shape
    out = torch.empty(M, dtype=torch.float32, device=a.device)
    if M == 0:
        return out
    if torch_path(a):
        return (a.double() * b.double()).sum(1).float()
    with device.on_device(a.device):
        block = min(4096, triton.next_power_of_2(N))
        precompile.launch(_rowdot_kernel, (M,), a, b, out, N, a.stride(0), b.stride(0), BLOCK=block)
    return out


@triton.jit
def _scale_columns_kernel(w_ptr, g_ptr, out_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    g = tl.load(g_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (w * g).to(out_ptr.dtype.element_ty), mask=m)


def scale_columns(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``w * gamma`` over the columns of a contiguous [R, D] weight, the product
    formed in fp32 and rounded once to w's dtype (one pass over w)."""
    if w.dim() != 2 or not w.is_contiguous() or gamma.shape != (w.shape[1],):
        raise ValueError(
            f"need a contiguous [R, D] w and a [D] gamma, got {tuple(w.shape)} and {tuple(gamma.shape)}"
        )
    if torch_path(w) or w.numel() == 0:
        return (w.float() * gamma.float()).to(w.dtype)
    R, D = w.shape
    out = torch.empty_like(w)
    with device.on_device(w.device):
        grid = (triton.cdiv(R, 32), triton.cdiv(D, 256))
        precompile.launch(_scale_columns_kernel, grid, w, gamma, out, R, D, BLOCK_R=32, BLOCK_D=256)
    return out


@triton.jit
def _gamma_sumsq_kernel(x_ptr, g_ptr, h_ptr, s_ptr, M, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        m = rmask[:, None] & (cols < D)[None, :]
        offs = rows64[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(h_ptr + offs, (x * g[None, :]).to(h_ptr.dtype.element_ty), mask=m)
        acc += tl.sum(x * x, axis=1)
    tl.store(s_ptr + rows, acc, mask=rmask)


def gamma_sumsq(x: torch.Tensor, gamma: torch.Tensor, dtype: torch.dtype | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """K1's outputs without its GEMM, for a norm with no projection before it (a first
    layer's, over the embeddings): ``(h, sumsq)``, h = x * gamma (formed in fp32, rounded
    once to ``dtype``, x's by default: the next GEMMs' over a float32 stream) and sumsq =
    the fp32 row sums of x^2. x: contiguous [M, d]."""
    if x.dim() != 2 or not x.is_contiguous() or gamma.shape != (x.shape[1],):
        raise ValueError(
            f"need a contiguous [M, d] x and a [d] gamma, got {tuple(x.shape)} and {tuple(gamma.shape)}"
        )
    M, D = x.shape
    dtype = x.dtype if dtype is None else dtype
    if torch_path(x, dtype) or M == 0:
        xf = x.float()
        return (xf * gamma.float()).to(dtype), xf.pow(2).sum(1)
    h = torch.empty_like(x, dtype=dtype)
    sumsq = torch.empty(M, dtype=torch.float32, device=x.device)
    block_d = min(1024, triton.next_power_of_2(D))
    with device.on_device(x.device):
        grid = (triton.cdiv(M, 4),)
        precompile.launch(_gamma_sumsq_kernel, grid, x, gamma, h, sumsq, M, D, BLOCK_M=4, BLOCK_D=block_d)
    return h, sumsq


@triton.jit
def _normalize_kernel(h_ptr, s_ptr, g_ptr, n_ptr, M, D, inv_d, eps, HAS_GAMMA: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < M
    m = rmask[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    r = rms_scale_of(tl.load(s_ptr + rows, mask=rmask, other=0.0), inv_d, eps)
    n = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32) * r[:, None]
    if HAS_GAMMA:
        n = n * tl.load(g_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    tl.store(n_ptr + offs, n.to(n_ptr.dtype.element_ty), mask=m)


def normalize_rows(h: torch.Tensor, sumsq: torch.Tensor, eps: float, gamma: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``n = h * r`` in h's dtype, r = rsqrt(sumsq / d + eps) per row, formed in fp32 and
    rounded once, in one pass over h: the normalized rows of a norm with no next GEMM to
    carry r (the last one, before the LM head). h: contiguous [M, d]; sumsq fp32 [M].
    (PyTorch's h.float() * r, .to(dtype) took three passes, 0.55 ms at 16384 x 4096, run 129.)
    With ``gamma`` [d], h is the norm's input x itself and n = x * r * gamma (float16's
    normalize-first forward, where the next GEMMs do not carry r either: ``_k1`` in
    ``ops/residual_rmsnorm.py``); ``out``: a contiguous [M, d] tensor on h's device to write
    n into (its dtype, which may differ from h's: a float32 stream's), else a new one in
    h's dtype."""
    if h.dim() != 2 or not h.is_contiguous() or sumsq.shape != (h.shape[0],) or sumsq.dtype != torch.float32:
        raise ValueError(
            f"need a contiguous [M, d] h and a float32 [M] sumsq, got {tuple(h.shape)} and "
            f"{sumsq.dtype} {tuple(sumsq.shape)}"
        )
    M, D = h.shape
    if gamma is not None and (gamma.shape != (D,) or gamma.device != h.device):
        raise ValueError(f"gamma must be [{D}] on {h.device}, got {tuple(gamma.shape)} on {gamma.device}")
    if out is not None and (out.shape != h.shape or not out.is_contiguous() or out.device != h.device):
        raise ValueError(f"out must be a contiguous tensor of shape {tuple(h.shape)} on {h.device}")
    gamma = None if gamma is None else gamma.contiguous()  # (the kernel reads it at unit stride)
    dtype = h.dtype if out is None else out.dtype
    if traced(h) or torch_path(h, dtype) or h.numel() == 0:
        n = h.float() * _r(sumsq, D, eps)
        n = (n if gamma is None else n * gamma.float()).to(dtype)
        return n if out is None else out.copy_(n)
    n = alloc((M, D), dtype, h.device) if out is None else out
    with device.on_device(h.device):
        grid = (triton.cdiv(M, 8), triton.cdiv(D, 512))
        precompile.launch(_normalize_kernel, grid, h, sumsq, h if gamma is None else gamma, n, M, D, 1.0 / D,
                          eps, HAS_GAMMA=gamma is not None, BLOCK_M=8, BLOCK_D=512, num_warps=4)  # fmt: skip
    return n


@triton.jit
def _rms_backward_finish_kernel(
    dn_ptr, x_ptr, dres_ptr, sumsq_ptr, zeta_ptr, gamma_ptr, dx_ptr, n_ptr, M, D, inv_d, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    r = rms_scale_of(tl.load(sumsq_ptr + rows, mask=rmask, other=1.0), inv_d, eps)
    zeta = tl.load(zeta_ptr + rows, mask=rmask, other=0.0)
    c = (r * r * zeta * inv_d)[:, None]  # [BM, 1]
    r = r[:, None]
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        m = rmask[:, None] & (cols < D)[None, :]
        offs = rows64[:, None] * D + cols[None, :]
        g = tl.load(gamma_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        dn = tl.load(dn_ptr + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        dres = tl.load(dres_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, (r * g * dn - c * x + dres).to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(n_ptr + offs, (x * r * g).to(n_ptr.dtype.element_ty), mask=m)


def rms_backward_finish(dn, x, dres, sumsq, zeta, gamma, eps, *, dx_out=None):
    """The RMSNorm backward after the dX GEMM stored dn = dz W and zeta = sum_k dn_k n_k:
    dx = r (gamma dn - x r zeta / d) + dres and n = x r gamma, r = rsqrt(sumsq / d + eps).

    dn, x, dres: contiguous [M, d]; sumsq, zeta fp32 [M]; gamma [d]. Returns (dx, n)
    in x's dtype. ``dx_out`` (optional, may be ``dn`` itself: each element is read
    before it is overwritten) receives dx."""
    M, D = x.shape
    dx = _check_rows(x, dx_out, dn=dn, dres=dres)
    n = torch.empty_like(x)
    if M == 0:
        return dx, n
    if torch_path(x):
        r = _r(sumsq, D, eps)
        g = gamma.float()
        xf = x.float()
        dx.copy_(r * (g * dn.float() - xf * r * zeta.float()[:, None] / D) + dres.float())
        n.copy_(xf * r * g)
        return dx, n
    with device.on_device(x.device):
        precompile.launch(_rms_backward_finish_kernel, (triton.cdiv(M, 16),),
            dn, x, dres, sumsq, zeta, gamma, dx, n, M, D, 1.0 / D, eps,
            BLOCK_M=16, BLOCK_D=min(256, triton.next_power_of_2(D)),
        )  # fmt: skip
    return dx, n


@triton.jit
def _rms_backward_rows_kernel(
    dh_ptr, x_ptr, dres_ptr, sumsq_ptr, gamma_ptr, dx_ptr, n_ptr, dgamma_ptr, low_ptr, dr_ptr,
    M, D, inv_d, eps, rows_per_prog,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_DRES: tl.constexpr,
    HAS_LOW: tl.constexpr, FACTORS: tl.constexpr,
):  # fmt: skip
    # each program walks its own run of whole rows (zeta needs the full row), one
    # read of dh, x (and dres) and one write of dx, n (and dx's low-precision copy)
    # per element; its dgamma partial stays in registers until the end. FACTORS: dh is
    # h's gradient and dr r's (the norm's output as h * r, rms_backward_factors): no
    # zeta, no n
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_GAMMA:
        g = tl.load(gamma_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        g = 1.0
    dg = tl.zeros([BLOCK_D], tl.float32)
    first = pid * rows_per_prog
    last = tl.minimum(first + rows_per_prog, M)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < last
        m = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        r1 = rms_scale_of(tl.load(sumsq_ptr + rows, mask=rmask, other=1.0), inv_d, eps)
        dh = tl.load(dh_ptr + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if FACTORS:
            # h = x gamma, r = rsqrt(sumsq / d + eps), sumsq = sum x^2: dr/dx = -r^3 x / d
            dr = tl.load(dr_ptr + rows, mask=rmask, other=0.0)
            if HAS_GAMMA:
                dg += tl.sum(dh * x, 0)
            dx = g * dh - x * (r1 * r1 * r1 * dr * inv_d)[:, None]
        else:
            r = r1[:, None]
            xr = x * r
            zeta = tl.sum(dh * g * xr, 1)
            if HAS_GAMMA:
                dg += tl.sum(dh * xr, 0)
            dx = r * g * dh - xr * (r1 * zeta * inv_d)[:, None]
        if HAS_DRES:
            dx += tl.load(dres_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
        if HAS_LOW:
            tl.store(low_ptr + offs, dx.to(low_ptr.dtype.element_ty), mask=m)
        if not FACTORS:
            tl.store(n_ptr + offs, (xr * g).to(n_ptr.dtype.element_ty), mask=m)
    if HAS_GAMMA:
        tl.store(dgamma_ptr + pid.to(tl.int64) * D + cols, dg, mask=cmask)


MAX_ROW = 16384  # the row kernel holds whole rows in registers


def rows_launch(d: int) -> tuple[int, int, int]:
    """``rms_backward_rows``'s launch for rows of d: (rows per step, block width, warps).
    Rows of 8192 and up take 32 warps: with 16, d 8192 (Llama-70B's width) held 128
    registers per thread and spilled 40-280 B for sm_90a; with 32, 41-62 and no spill
    (d 16384 still spills 16-216 B). CI's sm_90a check compiles d 2048-8192."""
    block_d = triton.next_power_of_2(d)
    return max(1, 8192 // block_d), block_d, 8 if block_d <= 4096 else 32


def row_pass_jobs() -> list[tuple]:
    """``rms_backward_rows`` as the sm_90a check compiles it (``programs/sm90_check.py``):
    (label, kernel, argument types, constexprs, warps), bf16, d 2048, 4096 and 8192, with
    and without gamma and a downstream gradient; and over a float32 stream (x, dres, dx
    float32, dx's bf16 copy written too); and ``rms_backward_factors`` as the drop-in's
    final norm runs it (gamma, no downstream gradient), both streams."""
    bf, f32 = "*bf16", "*fp32"
    jobs = []
    for d in (2048, 4096, 8192):
        block_m, block_d, warps = rows_launch(d)
        for stream in (bf, f32):
            types = {"dh_ptr": bf, "x_ptr": stream, "dres_ptr": stream, "sumsq_ptr": f32, "gamma_ptr": bf,
                     "dx_ptr": stream, "n_ptr": bf, "dgamma_ptr": f32, "low_ptr": bf, "dr_ptr": f32,
                     "M": "i32", "D": "i32", "inv_d": "fp32", "eps": "fp32",
                     "rows_per_prog": "i32"}  # fmt: skip
            low = stream == f32
            for gamma, dres, factors in ((True, True, False), (True, False, False), (False, True, False),
                                         (False, False, False), (True, False, True)):  # fmt: skip
                consts = {"BLOCK_M": block_m, "BLOCK_D": block_d, "HAS_GAMMA": gamma, "HAS_DRES": dres,
                          "HAS_LOW": low, "FACTORS": factors}  # fmt: skip
                with_ = "".join(f" {k}" for k, on in (("gamma", gamma), ("dres", dres),
                                                      ("float32 stream", low)) if on)  # fmt: skip
                label = f"rms_backward_{'factors' if factors else 'rows'} d {d}{with_}, {warps} warps"
                jobs.append((label, _rms_backward_rows_kernel, types, consts, warps))
    return jobs


def rms_backward_rows(dh, x, dres, sumsq, gamma, eps, *, dx_out=None, low_out=None):
    """The RMSNorm backward as one pass over whole rows, from dh = dz W (the plain dX GEMM):
    r = rsqrt(sumsq / d + eps),  zeta = sum_k dh_k gamma_k x_k r,
    dx = r (gamma dh - x r zeta / d) + dres,  n = x r gamma (the next GEMM's input, for
    its dW), and dgamma partials [programs, d] (sum them over dim 0) of dh x r over
    each program's rows.

    dh, x, dres: contiguous [M, d], d <= 16384 (dres None: no gradient from downstream,
    none read); sumsq fp32 [M]; gamma [d], or None for a norm without a scale (then
    n = x r and no dgamma: None is returned).
    Returns (dx, n, dgamma partials); ``dx_out`` (may be ``dh``: each element is
    read before it is written over) receives dx. A float32 stream (x, dres float32, dh
    bf16/fp16: ``ops/norm_checks.mixed``): dx is float32, n in dh's dtype, and
    ``low_out`` (a [M, d] tensor of dh's dtype, may be ``dh``) receives dx rounded to it,
    for the GEMMs that take it.
    """
    return _row_backward(dh, None, x, dres, sumsq, gamma, eps, dx_out, low_out)


def rms_backward_factors(dh, dr, x, dres, sumsq, gamma, eps, *, dx_out=None, low_out=None):
    """The RMSNorm backward where the norm's output n = h r was handed on as its two
    factors, h = x gamma and r = rsqrt(sumsq / d + eps) (``residual_rmsnorm_factors``: the
    LM head + loss scales its logits' rows by r, and n is never formed), from their
    gradients dh ([M, d], h's dtype) and dr (fp32 [M]): one pass over the rows,

        dx = gamma dh - x r^3 dr / d + dres,  dgamma partials of dh x (as rms_backward_rows'),

    no zeta (dr carries it) and no n. Arguments and the float32 stream as
    ``rms_backward_rows``'; returns (dx, dgamma partials)."""
    if dr.shape != (x.shape[0],) or dr.dtype != torch.float32:
        raise ValueError(f"dr must be float32 [{x.shape[0]}], got {dr.dtype} {tuple(dr.shape)}")
    dx, _, dgamma = _row_backward(dh, dr.contiguous(), x, dres, sumsq, gamma, eps, dx_out, low_out)
    return dx, dgamma


def _row_backward(dh, dr, x, dres, sumsq, gamma, eps, dx_out, low_out):
    """``rms_backward_rows`` (dr None) or ``rms_backward_factors``: (dx, n or None, dgamma
    partials)."""
    M, D = x.shape
    dx = _check_rows(x, dx_out, **({} if dres is None else {"dres": dres}))
    if dh.shape != x.shape or not dh.is_contiguous():
        raise ValueError(f"dh must be contiguous with x's shape {tuple(x.shape)}, got {tuple(dh.shape)}")
    if dh.dtype != x.dtype and x.dtype != torch.float32:
        raise TypeError(f"dh ({dh.dtype}) must have x's dtype ({x.dtype}), or x be a float32 stream")
    if low_out is not None and (low_out.shape != x.shape or low_out.dtype != dh.dtype
                                or not low_out.is_contiguous()):  # fmt: skip
        raise ValueError(f"low_out must be a contiguous {dh.dtype} tensor of shape {tuple(x.shape)}")
    if sumsq.shape != (M,) or (gamma is not None and gamma.shape != (D,)):
        raise ValueError("sumsq must be [M] and gamma [d]")
    if D > MAX_ROW:
        raise ValueError(f"the rowwise RMSNorm backward holds whole rows: d = {D} > {MAX_ROW}; use two_pass")
    factors = dr is not None
    n = None if factors else torch.empty_like(dh)
    on_cpu = x.device.type == "cpu"
    block_m, block_d, warps = rows_launch(D)
    slots = 4 if on_cpu else 4 * device.num_sms(x.device.index or 0)
    programs = max(1, min(slots, triton.cdiv(M, block_m)))
    rows_per_prog = max(1, triton.cdiv(triton.cdiv(M, programs), block_m)) * block_m
    programs = max(1, triton.cdiv(M, rows_per_prog))
    dgamma = None if gamma is None else torch.empty((programs, D), dtype=torch.float32, device=x.device)
    if M == 0:
        return dx, n, None if dgamma is None else dgamma.zero_()
    if torch_path(x, dh.dtype):
        r = _r(sumsq, D, eps)
        g, xf, dhf = (1.0 if gamma is None else gamma.float()), x.float(), dh.float()
        if factors:
            part, out = dhf * xf, g * dhf - xf * (r**3 * dr[:, None] / D)
        else:
            zeta = (dhf * g * xf * r).sum(1, keepdim=True)
            part, out = dhf * xf * r, r * (g * dhf - xf * r * zeta / D)
            n.copy_(xf * r * g)
        if dgamma is not None:
            pad = programs * rows_per_prog - M
            dgamma.copy_(torch.nn.functional.pad(part, (0, 0, 0, pad)).view(programs, -1, D).sum(1))
        dx.copy_(out + (0.0 if dres is None else dres.float()))
        if low_out is not None:
            low_out.copy_(dx)
        return dx, n, dgamma
    with device.on_device(x.device):
        precompile.launch(_rms_backward_rows_kernel, (programs,),
            dh, x, dx if dres is None else dres, sumsq, gamma, dx, dh if factors else n, dgamma,
            dh if low_out is None else low_out, sumsq if dr is None else dr, M, D, 1.0 / D, eps,
            rows_per_prog, BLOCK_M=block_m, BLOCK_D=block_d, HAS_GAMMA=gamma is not None,
            HAS_DRES=dres is not None, HAS_LOW=low_out is not None, FACTORS=factors,
            num_warps=warps,
        )  # fmt: skip
    return dx, n, dgamma
