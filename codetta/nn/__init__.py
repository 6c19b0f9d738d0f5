"""nn.Module forms of the operators."""

from .residual_rmsnorm import ResidualRMSNormLinear
from .swiglu import SwiGLUMLP

__all__ = ["ResidualRMSNormLinear", "SwiGLUMLP"]
