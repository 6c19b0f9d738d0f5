"""nn.Module forms of the operators."""

from .cross_entropy import LinearCrossEntropyLoss
from .residual_rmsnorm import ResidualRMSNormLinear
from .swiglu import SwiGLUMLP

__all__ = ["LinearCrossEntropyLoss", "ResidualRMSNormLinear", "SwiGLUMLP"]
