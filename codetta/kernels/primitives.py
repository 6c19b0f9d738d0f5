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
def gelu_tanh(x):
    """GELU, tanh approximation (as torch's approximate='tanh')."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 * sigmoid(2.0 * inner) - 1.0))


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
