"""Issue 'LM head + cross-entropy' benchmark: the LM head and its mean loss, forward
and forward+backward, at 8192 and 16384 tokens, d 2048 and 4096, V 128256 (and V
262144 at 16384 x 4096 for memory), against the cuBLAS time of the same GEMMs (the
logits; plus dX and dW), eager PyTorch (``F.cross_entropy(F.linear(x, w).float(), t)``),
torch.compile of it and Liger's fused linear cross-entropy, and codetta's low-memory
mode (``vocab_chunk``, slices of ``LOW_MEMORY_CHUNK`` classes), ``codetta:dx-f32`` (dX kept
in float32 to the backward's scale, ``CODETTA_CE_DX_F32``) and ``codetta:row-scale`` (the
logits' rows scaled in the epilogue, ``row_scale=``, as the drop-in's final norm passes its
rstd; a scale of ones here, so the values are the plain ones) and ``codetta:ce-chunk-2g`` (row
chunks of 2 GiB of logits, ``CODETTA_CE_CHUNK_MB=2048``: half the passes over the float32
dW sum, one chunk and no sum at 8192 tokens; 1 GiB more memory) and ``codetta:ce-probs``
(``CODETTA_CE_PROBS=1``, experimental: q = exp(l - ref) stored, no gradient pass). Also
each variant's peak
memory beyond its inputs, and whether codetta's loss has the same bits on two runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.settings import override
from ..ops import linear_cross_entropy
from .harness import (
    Results,
    add_rows,
    check_to_eager,
    compare,
    no_grad_call,
    peak_memory_gb,
    run_fwd_bwd_cases,
    selected,
)

# (tokens, d, V)
CASES = (
    (8192, 2048, 128256),
    (16384, 2048, 128256),
    (8192, 4096, 128256),
    (16384, 4096, 128256),
    (16384, 4096, 262144),
)


def eager(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


LOW_MEMORY_CHUNK = 4096


def codetta(x, w, t):
    return linear_cross_entropy(x, w, t)


def codetta_low_memory(x, w, t):
    return linear_cross_entropy(x, w, t, vocab_chunk=LOW_MEMORY_CHUNK)


def codetta_dx_f32(x, w, t):
    """codetta with ``CODETTA_CE_DX_F32=1``: dX kept in float32 to the backward's scale (the
    A/B of its cost: a float32 dX write and a cast pass; NOTES.md)."""
    with override(ce_dx_f32=True):
        return linear_cross_entropy(x, w, t)


def codetta_row_scale(x, w, t):
    """codetta with a row scale (ones: the same values as ``codetta``): the row-scaled logits
    program and gradient pass the drop-in's final norm runs, timed against the plain ones."""
    return linear_cross_entropy(x, w, t, row_scale=torch.ones(t.shape, device=t.device))


def codetta_chunk_2g(x, w, t):
    """codetta with ``CODETTA_CE_CHUNK_MB=2048``: twice the rows per chunk, so half the
    read-modify-write passes over the float32 dW sum (their cost against the memory:
    NOTES.md, runs 226-230)."""
    with override(ce_chunk_mb=2048):
        return linear_cross_entropy(x, w, t)


def codetta_probs(x, w, t):
    """codetta with ``CODETTA_CE_PROBS=1`` (experimental): the logits GEMM stores q = exp(l -
    ref) for a per-row reference, so no gradient pass runs over the chunk (NOTES.md)."""
    with override(ce_probs=True):
        return linear_cross_entropy(x, w, t)


# codetta's variants here (the CLI's --variants offers each name: __main__.PART_VARIANTS, and
# the model part's setting variants, whose names the ce-* ones share: the same settings)
CODETTA_VARIANTS = {
    "codetta": codetta,
    "codetta:low-memory": codetta_low_memory,
    "codetta:dx-f32": codetta_dx_f32,
    "codetta:row-scale": codetta_row_scale,
    "codetta:ce-chunk-2g": codetta_chunk_2g,
    "codetta:ce-probs": codetta_probs,
}


def liger_fn():
    """Liger's fused linear cross-entropy (chunked, bf16 weight gradient); None without it."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, t: loss(w, x, t)


def problem(tokens: int, d: int, V: int, device="cuda", dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(tokens, d, device=device, generator=g) * 0.5).to(dtype)
    w = (torch.randn(V, d, device=device, generator=g) * d**-0.5).to(dtype)
    t = torch.randint(0, V, (tokens,), device=device, generator=g)
    t[::17] = -100  # some ignored rows
    return {"leaves": [x.requires_grad_(), w.requires_grad_()], "target": t}


def cublas_gemms(p: dict, backward: bool):
    x, w = (t.detach() for t in p["leaves"])
    logits = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

    @torch.no_grad()
    def run():
        torch.mm(x, w.t(), out=logits)
        if backward:
            return logits @ w, logits.t() @ x
        return logits

    return run


def check(p: dict, fn, tol: float = 2e-2) -> dict:
    """Relative differences of ``fn``'s loss and gradients to eager's; raises past ``tol``."""
    (x, w), t = p["leaves"], p["target"]
    ref = eager(x, w, t)
    ref_g = torch.autograd.grad(ref, (x, w))
    got = fn(x, w, t)
    got_g = torch.autograd.grad(got, (x, w))
    return check_to_eager(("loss", "dx", "dw"), (got, *got_g), (ref, *ref_g), tol)


def same_bits(p: dict, fn=codetta) -> bool:
    """Two runs of ``fn`` give the same loss and gradients, bit for bit."""
    (x, w), t = p["leaves"], p["target"]
    runs = []
    for _ in range(2):
        loss = fn(x, w, t)
        runs.append((loss.detach(), *torch.autograd.grad(loss, (x, w))))
    return all(torch.equal(a, b) for a, b in zip(*runs))


def run_case(res_fwd: Results, res_bwd: Results, shape: tuple[int, int, int]):
    tokens, d, V = shape
    case = f"T {tokens} d {d} V {V}"
    p = problem(tokens, d, V)
    (x, w), t = p["leaves"], p["target"]
    variants = {"eager": eager, "torch.compile": torch.compile(eager), **CODETTA_VARIANTS}
    liger = liger_fn()
    if liger is not None:
        variants["liger"] = liger
    for name, fn in CODETTA_VARIANTS.items():
        errs = check(p, fn)
        print(f"  {case}: {name} vs eager {', '.join(f'{k} {v:.1e}' for k, v in errs.items())}; "
              f"same bits on two runs: {same_bits(p, fn)}")  # fmt: skip

    def fwd(fn):
        return no_grad_call(fn, x, w, t)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(x, w, t), (x, w))

    flops = 2 * tokens * d * V
    fns = {"cublas": cublas_gemms(p, backward=False), **{k: fwd(v) for k, v in variants.items()}}
    add_rows(res_fwd, f"{case} fwd", flops, compare(fns))
    fns = {"cublas": cublas_gemms(p, backward=True), **{k: fwd_bwd(v) for k, v in variants.items()}}
    mem = {k: peak_memory_gb(fn) for k, fn in selected(fns).items() if k != "cublas"}
    add_rows(res_bwd, f"{case} fwd+bwd", 3 * flops, compare(fns), mem)


def run(out_dir: str, cases=CASES) -> list[Results]:
    return run_fwd_bwd_cases(
        out_dir, "ce", cases, run_case, lambda c: "LM head + cross-entropy, {} tokens, d {}, V {}".format(*c)
    )
