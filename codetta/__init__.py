"""codetta: Transformer blocks as GEMM + epilogue programs, on Triton."""

from . import nn, ops  # noqa: E402
from ._version import __version__
from .kernels.configs import Config  # noqa: E402
from .kernels.device import interpreting  # noqa: E402
from .kernels.launch import gemm  # noqa: E402
from .kernels.program import (  # noqa: E402
    ColSum,
    DType,
    HalfTile,
    Kind,
    PerCol,
    PerRow,
    Program,
    RowLogSumExp,
    RowPick,
    RowSum,
    RowTable,
    Scalar,
    Tile,
)

__all__ = [
    "gemm",
    "interpreting",
    "Program",
    "Tile",
    "HalfTile",
    "PerRow",
    "PerCol",
    "Scalar",
    "DType",
    "RowTable",
    "RowSum",
    "RowLogSumExp",
    "RowPick",
    "ColSum",
    "Kind",
    "Config",
    "nn",
    "ops",
    "__version__",
]
