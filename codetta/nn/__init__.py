"""nn.Module forms of the operators."""

from .residual_rmsnorm import ResidualRMSNormLinear

__all__ = ["ResidualRMSNormLinear"]
