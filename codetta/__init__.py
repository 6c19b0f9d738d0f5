"""codetta: Transformer blocks as GEMM + epilogue programs, on Triton."""

__version__ = "0.1.0"

from . import nn, ops  # noqa: E402
from .kernels.launch import gemm, interpreting  # noqa: E402
from .kernels.program import Epilogue, Kind, Layout, Operand  # noqa: E402
from .kernels.tuning import Config  # noqa: E402

__all__ = [
    "gemm",
    "interpreting",
    "Epilogue",
    "Kind",
    "Operand",
    "Layout",
    "Config",
    "nn",
    "ops",
    "__version__",
]
