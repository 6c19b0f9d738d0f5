"""Operators: autograd functions registered through torch.library, one per file."""

from .residual_rmsnorm import residual_rmsnorm_linear

__all__ = ["residual_rmsnorm_linear"]
