"""Pairwise rotation of adjacent output columns (the RoPE pattern)."""

import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope

from .. import reference as ref
from ..kernels import primitives as P
from ..kernels.program import PerRow, Program, Tile


@triton.jit
def rotate_pairs(acc, cos, sin):
    """For each column pair (a, b) = (acc[:, 2i], acc[:, 2i+1]) of row m, with c = cos[m], s = sin[m]:
    out[:, 2i] = a c - b s,  out[:, 2i+1] = b c + a s."""
    # scale before splitting: per-row factors then share the halves' register layout
    # (the ping-pong mainloop does not convert layouts behind a body's back)
    ac, bc = P.even_odd(acc * cos)
    a_s, b_s = P.even_odd(acc * sin)
    return P.interleave(ac - b_s, bc + a_s)


def _check_even(M, N):
    if N % 2:
        raise ValueError(f"rotate_pairs pairs adjacent columns: N must be even, got N={N}")


ROTATE_PAIRS = Program(
    "rotate_pairs",
    rotate_pairs,
    inputs=(PerRow("cos"), PerRow("sin")),
    outputs=(Tile("out"),),
    reference=lambda acc, cos, sin: {"out": ref.rotate_pairs(acc, cos.to(acc.dtype), sin.to(acc.dtype))},
    check=_check_even,
)
