"""Epilogue programs: each a few lines over the primitives of codetta.kernels.primitives."""

from .basic import MUL_COLSUM, ROW_SCALE, STORE
from .lse import TILE_LSE
from .norm import GAMMA_WEIGHT_GRAD, RESIDUAL_RMS, RESIDUAL_SUMSQ, RMS_BACKWARD, RMS_GRAD_PARTIALS
from .rope import ROTATE_PAIRS

__all__ = [
    "STORE",
    "ROW_SCALE",
    "MUL_COLSUM",
    "RESIDUAL_RMS",
    "RESIDUAL_SUMSQ",
    "GAMMA_WEIGHT_GRAD",
    "RMS_BACKWARD",
    "RMS_GRAD_PARTIALS",
    "TILE_LSE",
    "ROTATE_PAIRS",
]
