"""Operators: autograd functions registered through torch.library, one per file."""

from .cross_entropy import linear_cross_entropy
from .residual_rmsnorm import residual_rmsnorm_linear

__all__ = ["residual_rmsnorm_linear", "linear_cross_entropy"]
