"""Issue 'Operators III' benchmark: RMSNorm-scaled q/k/v projections with RoPE (and
Qwen3's per-head q/k norm) at 16384 tokens (4 x 4096), forward and forward+backward,
against the cuBLAS time of the same GEMMs, eager PyTorch (Hugging Face's RMSNorm and
``apply_rotary_pos_emb`` math with cuBLAS GEMMs), torch.compile of it and Liger (its
RMSNorm and RoPE kernels with cuBLAS GEMMs).

Every variant starts from the layer's input x and the norm's weight, and ends with q, k
and v as [B, H, S, head_dim] views for SDPA (codetta's are transposed views of its
[B, S, H * head_dim] outputs, which SDPA's flash and cuDNN backends read as they are).
cos and sin are made once outside the timed region for the peers (a model makes them
once per forward); codetta forms its angles in the epilogue. The incoming gradients have
the memory layout of each variant's own outputs (as SDPA's backward returns them).
The floor: the three projections' GEMMs (forward), plus their dX and dW (backward).
``codetta:qkv-one-launch``: codetta with ``CODETTA_QKV_ONE_LAUNCH=1`` (q, k, v and their
weight gradients from one launch each where the case allows; Qwen3's keeps three).
``codetta:no-direct`` (fwd+bwd): codetta with ``CODETTA_DIRECT_LAUNCH=0`` (every launch
through Triton's own path: what the direct launches save, in the host-bound 1B row).
The cases "1B-pairs" and "8B-pairs" (``--qkv-cases``, not run by default) rotate in the
interleaved-pairs convention (``RoPE(interleaved=True)``: Meta's original Llama code,
torchtitan): eager and torch.compile then rotate columns 2i and 2i + 1 together; Liger
has no such RoPE and sits them out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import RoPE, rmsnorm_linear
from .harness import (
    Results,
    add_rows,
    check_to_eager,
    compare,
    host_ms,
    no_grad_call,
    peak_memory_gb,
    run_fwd_bwd_cases,
    selected,
    triton_only,
    with_settings,
)

BATCH, SEQ = 4, 4096
EPS = 1e-5
# name: (d, q heads, kv heads, head_dim, per-head q/k norm, interleaved-pairs RoPE)
CASES = {
    "1B": (2048, 32, 8, 64, False, False),
    "8B": (4096, 32, 8, 128, False, False),
    "qwen3-8B": (4096, 32, 8, 128, True, False),
    "1B-pairs": (2048, 32, 8, 64, False, True),
    "8B-pairs": (4096, 32, 8, 128, False, True),
}
DEFAULT_CASES = ("1B", "8B", "qwen3-8B")  # issue 'Operators III''s cases


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x):
    """The interleaved-pairs convention's partner of each column: (-x[2i + 1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rms(x, w, eps):
    """Hugging Face's LlamaRMSNorm / Qwen3RMSNorm math: fp32 statistics, the normalized
    input rounded to x's dtype, then times the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager(p: dict, x, gamma, wq, wk, wv, *qk):
    """The Hugging Face path: RMSNorm, three cuBLAS projections, (per-head q/k norms),
    [B, H, S, hd] views, apply_rotary_pos_emb (or its interleaved-pairs form)."""
    B, S, hd, eps = p["batch"], p["seq"], p["head_dim"], p["eps"]
    n = _rms(x, gamma, eps)
    q, k, v = (F.linear(n, w).view(B, S, -1, hd) for w in (wq, wk, wv))
    if qk:
        q, k = _rms(q, qk[0], eps), _rms(k, qk[1], eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = p["cos"].unsqueeze(1), p["sin"].unsqueeze(1)
    rot = _rotate_pairs if p["pairs"] else _rotate_half
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin, v


def liger_fn():
    """Liger's kernels in the same places (its RMSNorm for the layer norm and the q/k
    norms, its RoPE), cuBLAS GEMMs; None without liger-kernel."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None

    def liger(p, x, gamma, wq, wk, wv, *qk):
        B, S, hd, eps = p["batch"], p["seq"], p["head_dim"], p["eps"]
        n = LigerRMSNormFunction.apply(x, gamma, eps, 0.0, "llama", True)
        q, k, v = (F.linear(n, w).view(B, S, -1, hd) for w in (wq, wk, wv))
        if qk:
            q = LigerRMSNormFunction.apply(q, qk[0], eps, 0.0, "llama", True)
            k = LigerRMSNormFunction.apply(k, qk[1], eps, 0.0, "llama", True)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = liger_rotary_pos_emb(q, k, p["cos"], p["sin"])
        return q, k, v

    return liger


def codetta(p: dict, x, gamma, wq, wk, wv, *qk):
    """One row pass (the norm's statistics), then q, k, v from their GEMMs with the norm's
    scale, the q/k norms and RoPE in the epilogues."""
    B, S, hd = p["batch"], p["seq"], p["head_dim"]
    rope = RoPE(p["positions"], p["inv_freq"], qk_norm_weights=tuple(qk), qk_norm_eps=p["eps"],
                interleaved=p["pairs"])  # fmt: skip
    q, k, v = rmsnorm_linear(x, gamma, (wq, wk, wv), p["eps"], rope=rope)
    return tuple(t.view(B, S, -1, hd).transpose(1, 2) for t in (q, k, v))


def problem(case: str, device="cuda", dtype=torch.bfloat16, batch=BATCH, seq=SEQ, dims=None) -> dict:
    """Inputs of one case (``dims`` overrides CASES' (d, heads, kv heads, head_dim,
    qk norm, interleaved pairs), for small CPU checks)."""
    d, h, kv, hd, qk, pairs = dims or CASES[case]
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    leaves = [rand(batch, seq, d), torch.rand(d, device=device, generator=g).to(dtype) + 0.5]
    leaves += [rand(n * hd, d, scale=d**-0.5) for n in (h, kv, kv)]
    if qk:
        leaves += [torch.rand(hd, device=device, generator=g).to(dtype) + 0.5 for _ in range(2)]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    positions = torch.arange(seq, device=device).repeat(batch, 1)
    angle = positions[..., None].float() * inv_freq
    # each column's angle: the halves' (rotate-half), or each pair's twice (interleaved)
    emb = angle.repeat_interleave(2, dim=-1) if pairs else torch.cat((angle, angle), dim=-1)
    return {
        "leaves": [t.requires_grad_() for t in leaves],
        "batch": batch, "seq": seq, "head_dim": hd, "eps": EPS, "inv_freq": inv_freq, "pairs": pairs,
        "positions": positions, "cos": emb.cos().to(dtype), "sin": emb.sin().to(dtype),
        "grads": [rand(batch, n, seq, hd) for n in (h, kv, kv)],
    }  # fmt: skip


def gemm_shapes(p: dict) -> list[tuple[int, int, int]]:
    """(M, N, K) of the three forward projections."""
    x, _, *ws = p["leaves"][:5]
    return [(x.shape[0] * x.shape[1], w.shape[0], w.shape[1]) for w in ws]


def cublas_gemms(p: dict, backward: bool):
    x, _, *ws = (t.detach() for t in p["leaves"][:5])
    n = x.reshape(-1, x.shape[-1])
    dzs = [torch.randn(n.shape[0], w.shape[0], device=n.device).to(n.dtype) for w in ws]

    @torch.no_grad()
    def run():
        out = [n @ w.t() for w in ws]
        if backward:
            out += [dz @ w for dz, w in zip(dzs, ws)] + [dz.t() @ n for dz in dzs]
        return out

    return run


def _grads_like(outs, grads):
    """The incoming gradients in the memory layout of the variant's own outputs."""
    return [torch.empty_like(o).copy_(g) for o, g in zip(outs, grads)]


def fwd_bwd(p: dict, fn):
    """One forward + backward of the variant ``fn`` on the problem ``p`` as a callable, the
    incoming gradients in the layout of its own outputs (what the fwd+bwd rows time)."""
    leaves = p["leaves"]
    grads = _grads_like(fn(p, *leaves), p["grads"])
    return lambda: torch.autograd.grad(fn(p, *leaves), leaves, grads)


def check(p: dict, fn, tol: float = 3e-2) -> dict:
    """Relative differences of ``fn``'s outputs and gradients to eager's; raises past ``tol``."""
    leaves = p["leaves"]
    ref = eager(p, *leaves)
    ref_g = torch.autograd.grad(ref, leaves, _grads_like(ref, p["grads"]))
    out = fn(p, *leaves)
    got_g = torch.autograd.grad(out, leaves, _grads_like(out, p["grads"]))
    names = ["q", "k", "v", "dx", "dgamma", "dwq", "dwk", "dwv", "dq_norm", "dk_norm"]
    return check_to_eager(names, [*out, *got_g], [*ref, *ref_g], tol)


def run_case(res_fwd: Results, res_bwd: Results, case: str):
    p = problem(case)
    leaves = p["leaves"]
    variants = {"eager": eager, "torch.compile": torch.compile(eager), "codetta": codetta}
    liger = None if p["pairs"] else liger_fn()
    if liger is not None:
        variants["liger"] = liger
    for name in ("codetta", "liger"):
        if name in variants:
            worst = max(check(p, variants[name]).items(), key=lambda kv: kv[1])
            print(f"  {case} {name}: largest relative difference to eager {worst[1]:.2e} ({worst[0]})")

    def fwd(fn):
        return no_grad_call(fn, p, *leaves)

    flops = sum(2 * M * N * K for M, N, K in gemm_shapes(p))
    fns = {"cublas": cublas_gemms(p, backward=False), **{k: fwd(v) for k, v in variants.items()}}
    fns["codetta-triton"] = triton_only(fns["codetta"])
    fns["codetta:qkv-one-launch"] = with_settings(fns["codetta"], qkv_one_launch=True)
    add_rows(res_fwd, f"{case} fwd", flops, compare(fns))
    fns = {"cublas": cublas_gemms(p, backward=True), **{k: fwd_bwd(p, v) for k, v in variants.items()}}
    fns["codetta-triton"] = triton_only(fns["codetta"])
    fns["codetta:qkv-one-launch"] = with_settings(fns["codetta"], qkv_one_launch=True)
    fns["codetta:no-direct"] = with_settings(fns["codetta"], direct_launch=False)
    mem = {k: peak_memory_gb(fn) for k, fn in selected(fns).items() if k != "cublas"}
    times = compare(fns)
    # (the 1B case is ~1 ms of GPU work: the host's time per call shows who sets the pace)
    host = {k: host_ms(fn) for k, fn in selected(fns).items()}
    add_rows(res_bwd, f"{case} fwd+bwd", 3 * flops, times, mem, host=host)


def run(out_dir: str, cases=DEFAULT_CASES) -> list[Results]:
    return run_fwd_bwd_cases(out_dir, "qkv", cases, run_case, lambda c: f"RMSNorm + q/k/v + RoPE, {c}")
