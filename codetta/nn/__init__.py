"""nn.Module forms of the operators."""

from .cross_entropy import LinearCrossEntropyLoss
from .qkv import RMSNormQKVRoPE
from .residual_rmsnorm import ResidualRMSNormLinear
from .swiglu import SwiGLUMLP

__all__ = ["LinearCrossEntropyLoss", "RMSNormQKVRoPE", "ResidualRMSNormLinear", "SwiGLUMLP"]
