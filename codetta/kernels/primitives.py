"""Math helpers for program bodies: elementwise and pairwise transforms.

Bodies (``program.py``) are plain ``@triton.jit`` math over register tensors, so
these helpers run in both mainloops and in the Triton interpreter. They create
no index tensors (``tl.arange``) and touch no memory.
"""

import triton
import triton.language as tl


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def tanh(x):
    """2 sigmoid(2x) - 1 (saturates to +-1 without overflow)."""
    return 2.0 * sigmoid(2.0 * x) - 1.0


@triton.jit
def gelu_tanh(x):
    """GELU, tanh approximation (as torch's approximate='tanh')."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner))


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
    (three-part constant: exact for |x| < ~2^17), then minimax polynomials on
    [-pi/4, pi/4] (absolute error ~1e-7 plus ~|x| 2^-24 from the reduction). libdevice's
    sinf/cosf keep a slow path for huge arguments whose local array spills an epilogue's
    registers; these do not."""
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
