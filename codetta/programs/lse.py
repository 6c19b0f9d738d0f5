"""Log-sum-exp over each row of the product (the running max / sum-exp reduction)."""

import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope

from ..kernels.program import Program, RowLogSumExp, Scalar


@triton.jit
def scaled(acc, scale):
    """lse[m] = log sum_n exp(scale * acc[m, n])."""
    return acc * scale


ROW_LSE = Program(
    "row_lse",
    scaled,
    inputs=(Scalar("scale"),),
    outputs=(RowLogSumExp("lse"),),
    reference=lambda acc, scale: {"lse": (acc * scale).logsumexp(1)},
)
