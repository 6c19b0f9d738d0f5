"""Basic epilogue programs: plain store, accumulate into a tile, row scaling, a product's
column sums."""

import dataclasses

import torch
import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope

from ..kernels.configs import BACKWARD_CANDIDATES, SEEDED_CANDIDATES
from ..kernels.program import STORE, ColSum, PerRow, Program, Tile, with_k_parts, with_m_parts

__all__ = ["STORE", "STORE_F32", "ACCUMULATE", "ACCUMULATE_F32", "FINISH_F32", "ROW_SCALE", "MUL_COLSUM",
           "STORE_K2", "STORE_K3", "STORE_K4", "STORE_M3"]  # fmt: skip


@triton.jit
def accumulate(acc):
    """out = c + A @ B^T (c seeds the accumulator): a sum of GEMMs without a separate add,
    e.g. the gradient of a norm's output that feeds several next GEMMs."""
    return acc


ACCUMULATE = Program(
    "accumulate",
    accumulate,
    inputs=(Tile("c", seeds_acc=True),),
    outputs=(Tile("out"),),
    reference=lambda acc, c: {"out": acc},
    configs=tuple(SEEDED_CANDIDATES),
    layouts=((False, True),),
)

# the sum of 2-4 products in one launch, rounded once: gemm(a, w, epilogue=STORE_K3, a1=, w1=,
# a2=, w2=) = a @ w.T + a1 @ w1.T + a2 @ w2.T, e.g. the dX of a norm that feeds the q, k and v
# projections, dh = dq Wq + dk Wk + dv Wv, from the weights as they are (no concatenation)
STORE_K2, STORE_K3, STORE_K4 = (
    dataclasses.replace(with_k_parts(STORE, n), layouts=((False, True),)) for n in (1, 2, 3)
)

# the weight gradients of several projections of one input in one launch: gemm(dq.t(),
# n.t(), epilogue=STORE_M3, a1=dk.t(), a2=dv.t()) -> (dWq, dWk, dWv), the three A operands
# stacked along M (M parts), each output its own tensor
STORE_M3 = dataclasses.replace(with_m_parts(STORE, 2), layouts=((True, True),))

# the same into a float32 accumulator, e.g. gemm(..., epilogue=ACCUMULATE_F32, c=acc, out=acc)
# summing a weight gradient over chunks of rows in place (on the ping-pong mainloop its
# epilogue ring is float32, two sub-tiles the seed streams through: pingpong.py)
ACCUMULATE_F32 = Program(
    "accumulate_f32",
    accumulate,
    inputs=(Tile("c", seeds_acc=True, dtype=torch.float32),),
    outputs=(Tile("out", dtype=torch.float32),),
    reference=lambda acc, c: {"out": acc},
    configs=tuple(BACKWARD_CANDIDATES),  # 128x128 tiles: a float32 seed tile fits shared memory
    layouts=((True, True),),
)

# the first chunk's term of such a sum: the product stored in float32 (no seed to read,
# no zero-filled buffer to write first)
STORE_F32 = Program(
    "store_f32",
    accumulate,
    outputs=(Tile("out", dtype=torch.float32),),
    reference=lambda acc: {"out": acc},
    configs=tuple(BACKWARD_CANDIDATES),
    layouts=((True, True),),
)


# the last chunk's term: the float32 sum so far plus this product, rounded once into the
# GEMM's dtype (a weight gradient's last chunk: no float32 result written, no cast pass after;
# on the ping-pong mainloop the seed streams through a float32 ring, the output is stored
# through a slot viewed in its dtype)
FINISH_F32 = Program(
    "finish_f32",
    accumulate,
    inputs=(Tile("c", seeds_acc=True, dtype=torch.float32),),
    outputs=(Tile("out"),),
    reference=lambda acc, c: {"out": acc},
    configs=tuple(BACKWARD_CANDIDATES),
    layouts=((True, True),),
)


@triton.jit
def row_scale(acc, scale):
    """out = acc * scale[m]  (scale: one value per output row)."""
    return acc * scale


ROW_SCALE = Program(
    "row_scale",
    row_scale,
    inputs=(PerRow("scale"),),
    outputs=(Tile("out"),),
    reference=lambda acc, scale: {"out": acc * scale.to(acc.dtype)[:, None]},
)


@triton.jit
def mul_colsum(acc, other):
    """out = acc;  colsum[n] = sum over m of acc * other."""
    return acc, acc * other


MUL_COLSUM = Program(
    "mul_colsum",
    mul_colsum,
    inputs=(Tile("other"),),
    outputs=(Tile("out"), ColSum("colsum")),
    reference=lambda acc, other: {"out": acc, "colsum": (acc * other.to(acc.dtype)).sum(0)},
)
