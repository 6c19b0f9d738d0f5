"""Epilogue programs: each a math-only body over its declared operands (kernels/program.py)."""

from .basic import (
    ACCUMULATE,
    ACCUMULATE_F32,
    FINISH_F32,
    MUL_COLSUM,
    ROW_SCALE,
    STORE,
    STORE_F32,
    STORE_K2,
    STORE_K3,
    STORE_K4,  # noqa: F401 - (a fourth next weight: no model has one; not in the sm_90a check's list)
    STORE_M3,
)
from .ce import CE_LOGITS, CE_LOGITS_EXT
from .lse import ROW_LSE
from .norm import (
    GAMMA_WEIGHT_GRAD,
    RESIDUAL_RMS,
    RESIDUAL_SUMSQ,
    RMS_BACKWARD,
    RMS_GRAD_PARTIALS,
    RMS_SCALE,
)
from .rope import (  # noqa: F401 - RMS_ROPE, RMS_ROPE_QKV and the PAIRS ones: every head dim
    RMS_QKNORM_ROPE,
    RMS_QKNORM_ROPE_128,
    RMS_QKNORM_ROPE_PAIRS,
    RMS_QKNORM_ROPE_PAIRS_64,
    RMS_QKNORM_ROPE_PAIRS_128,
    RMS_ROPE,
    RMS_ROPE_64,
    RMS_ROPE_128,
    RMS_ROPE_PAIRS,
    RMS_ROPE_PAIRS_64,
    RMS_ROPE_PAIRS_128,
    RMS_ROPE_QKV,
    RMS_ROPE_QKV_64,
    RMS_ROPE_QKV_128,
    ROTATE_PAIRS,
)
from .swiglu import DSWIGLU, DSWIGLU_Y, SWIGLU, SWIGLU_RMS

__all__ = [
    "STORE",
    "ACCUMULATE",
    "ACCUMULATE_F32",
    "FINISH_F32",
    "STORE_F32",
    "STORE_K2",
    "STORE_K3",
    "STORE_M3",
    "ROW_SCALE",
    "MUL_COLSUM",
    "RESIDUAL_RMS",
    "RESIDUAL_SUMSQ",
    "RMS_SCALE",
    "GAMMA_WEIGHT_GRAD",
    "RMS_BACKWARD",
    "RMS_GRAD_PARTIALS",
    "ROW_LSE",
    "CE_LOGITS",
    "CE_LOGITS_EXT",
    "ROTATE_PAIRS",
    "RMS_ROPE_64",
    "RMS_ROPE_128",
    "RMS_QKNORM_ROPE_128",
    "RMS_ROPE_PAIRS_128",
    "RMS_ROPE_PAIRS_64",
    "RMS_QKNORM_ROPE_PAIRS_64",
    "RMS_QKNORM_ROPE_PAIRS_128",
    "RMS_ROPE_QKV_64",
    "RMS_ROPE_QKV_128",
    "SWIGLU",
    "SWIGLU_RMS",
    "DSWIGLU",
    "DSWIGLU_Y",
]
