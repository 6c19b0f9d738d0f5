"""Operators: autograd functions registered through torch.library, one per file."""

from .cross_entropy import linear_cross_entropy
from .residual_rmsnorm import (
    SwiGLU,
    residual_rmsnorm,
    residual_rmsnorm_factors,
    residual_rmsnorm_linear,
    residual_rmsnorm_swiglu,
    rmsnorm_linear,
)
from .rope import RoPE
from .swiglu import swiglu_mlp
from .tied_embedding import TiedLink, embedding, tied_embedding

__all__ = [
    "residual_rmsnorm",
    "residual_rmsnorm_factors",
    "residual_rmsnorm_linear",
    "residual_rmsnorm_swiglu",
    "rmsnorm_linear",
    "SwiGLU",
    "RoPE",
    "swiglu_mlp",
    "linear_cross_entropy",
    "TiedLink",
    "tied_embedding",
    "embedding",
]
