"""Math helpers for program bodies: elementwise and pairwise transforms.

Bodies (``program.py``) are plain ``@triton.jit`` math over register tensors, so
these helpers run in both mainloops and in the Triton interpreter. They create
no index tensors (``tl.arange``) and touch no memory. One, ``sincos_approx``, runs
inline PTX on the GPU (the interpreter takes its plain-arithmetic twin).
"""

import triton
import triton.language as tl

# the Triton interpreter (TRITON_INTERPRET set when codetta was imported: 1, true, yes or
# on, as Triton's own jit decorator reads it) runs no PTX: the helpers that use inline PTX
# take their plain-arithmetic twin there
_INTERPRETED: tl.constexpr = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def tanh(x):
    """tanh in fp32 within ~2 ulp: an odd polynomial below |x| 0.625 (the coefficients of
    Cephes' tanhf), 1 - 2 / (exp(2 |x|) + 1) with x's sign above (saturates to +-1, no
    overflow). (2 sigmoid(2x) - 1, the form before, lost ~ulp(1) absolute: up to 1.8e7
    ulp near 0, and softcap times that in a soft-capped logit, NOTES.md.)"""
    a = tl.abs(x)
    z = x * x
    p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
    small = (p - 3.33332819422e-1) * z * x + x
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(a < 0.625, small, tl.where(x < 0.0, -big, big))


@triton.jit
def gelu_tanh(x):
    """GELU, tanh approximation (as torch's approximate='tanh')."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner))


@triton.jit
def rounded(acc, elem):
    """The accumulator rounded to ``elem``'s dtype (the GEMM's), back in float32. In fp16
    an add (of +0.0: exact, -0.0 turns +0.0) reads the accumulator first: where its first
    reader was fp16's packed convert of two accumulator registers, ptxas serialized the
    mainloop's wgmma (its C7514 / C7515; ce_logits ran at half speed, run 216, NOTES.md)."""
    if elem.dtype == tl.float16:
        acc = acc + 0.0
    return acc.to(elem.dtype).to(tl.float32)


@triton.jit
def halves(x):
    """[BM, W] -> its left and right halves, [BM, W/2] each."""
    BM: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, W // 2)), (0, 2, 1)))


@triton.jit
def whole(left, right):
    """Inverse of ``halves``: [BM, H] and [BM, H] -> [BM, 2H]."""
    BM: tl.constexpr = left.shape[0]
    H: tl.constexpr = left.shape[1]
    return tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (BM, 2 * H))


@triton.jit
def even_odd(x):
    """Split [BM, BNs] into its even and odd columns, [BM, BNs/2] each."""
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    return tl.split(tl.reshape(x, (BM, BN // 2, 2)))


@triton.jit
def interleave(even, odd):
    """Inverse of ``even_odd``: [BM, H] and [BM, H] -> [BM, 2H]."""
    BM: tl.constexpr = even.shape[0]
    H: tl.constexpr = even.shape[1]
    return tl.reshape(tl.join(even, odd), (BM, 2 * H))


@triton.jit
def sincos(x):
    """(sin x, cos x) in fp32, from arithmetic only: x is reduced by multiples of pi/2
    (three-part constant; each x - j C is one fused multiply-add on the GPU, exact to |x| ~
    4M; through the interpreter, whose products are rounded, only below ~2^17), then
    minimax polynomials on [-pi/4, pi/4] (absolute error ~1e-7). libdevice's sinf/cosf keep
    a slow path for huge arguments whose local array spills an epilogue's registers; these
    do not."""
    j = tl.floor(x * 0.6366197723675814 + 0.5)  # nearest multiple of pi/2
    r = ((x - j * 1.5703125) - j * 4.837512969970703125e-4) - j * 7.549789954891882e-8
    r2 = r * r
    s = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    c = (
        1.0
        - 0.5 * r2
        + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3 + r2 * 2.443315711809948e-5))
    )
    q = j.to(tl.int32) & 3
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    return sin, cos


@triton.jit
def _ptx_unary(x, op: tl.constexpr):
    return tl.inline_asm_elementwise(op + " $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def sincos_approx(x):
    """(sin x, cos x) in fp32 from the GPU's special-function unit: x reduced by multiples
    of 2 pi (three-part constant, 6.28125 + 1.934051513671875e-3 + 1.2556659e-6, each x - j C
    one fused multiply-add: exact to |x| ~ 4M, reduction error <= 1.2e-7 there), then PTX's
    ``sin.approx.f32`` / ``cos.approx.f32`` (absolute error <= 2^-20.9 on [-pi, pi]). About
    7 instructions for both against ~40 for ``sincos``'s polynomials, the same accuracy for a
    bf16 or fp16 result. In the interpreter: ``sincos``."""
    if _INTERPRETED:
        sin, cos = sincos(x)
    else:
        j = tl.floor(x * 0.15915494309189535 + 0.5)  # nearest multiple of 2 pi
        r = ((x - j * 6.28125) - j * 1.934051513671875e-3) - j * 1.2556659e-6
        sin = _ptx_unary(r, "sin.approx.f32")
        cos = _ptx_unary(r, "cos.approx.f32")
    return sin, cos
