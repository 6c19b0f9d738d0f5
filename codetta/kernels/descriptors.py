"""Host-side TMA descriptors and buffers both mainloops share: each operand slot's
descriptor shape and block, the A and B descriptors, and the tail split's per-stream
arrival counters (``engines.py`` builds the launches on them)."""

from __future__ import annotations

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import Config
from .operands import GemmCall, leading_stride
from .persistent import kept
from .program import REDUCTIONS, Kind

_K_PARTS = (Kind.K_PART_A, Kind.K_PART_B)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr function: slow on the host path


def tma_desc(base: torch.Tensor, shape, strides, block, layout=None):
    """A host TMA descriptor (Triton's, or Gluon's with ``layout``) built without its
    dataclass checks: the operands were validated once already (operands.py), and the
    checks cost ~10 us a descriptor, several per launch."""
    d = object.__new__(TensorDescriptor if layout is None else GluonTensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = base, shape, strides, block, "zero"
    if layout is not None:
        d.layout = layout
    return d


def tile_block(op, cfg: Config, whole: bool = False) -> list[int]:
    """The TMA block of a tile operand: a sub-tile (half as wide for a HalfTile), or
    the whole tile (the portable mainloop's seed)."""
    width = cfg.block_n if whole else cfg.sub_n
    return [cfg.block_m, width // 2 if op.kind is Kind.HALF_TILE else width]


def slot_dtype(op, dtype: torch.dtype) -> torch.dtype:
    """The dtype a slot's tensor has in the ahead-of-time compile (a launch specializes
    on the real tensors)."""
    if op.kind in REDUCTIONS or op.kind in (Kind.PER_ROW, Kind.PER_COL, Kind.ROW_TABLE):
        return torch.float32
    if op.kind is Kind.PER_ROW_INDEX:
        return torch.int64
    return op.dtype or dtype


def matrix_specs(call: GemmCall, cfg: Config):
    """(shape, strides, block) of the A and B descriptors."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    M, N, K = call.a.shape[0], call.w.shape[0], call.K  # (a's and the weight's own, not the parts')
    a_lead, w_lead = leading_stride(call.a, call.a_t), leading_stride(call.w, call.b_t)
    a = ([K, M], [a_lead, 1], [bk, bm]) if call.a_t else ([M, K], [a_lead, 1], [bm, bk])
    b = ([K, N], [w_lead, 1], [bk, bn]) if call.b_t else ([N, K], [w_lead, 1], [bn, bk])
    return a, b


def matrix_descs(make, call: GemmCall, cfg: Config):
    """The A and B descriptors (``make(t, shape, strides, block)``)."""
    a, b = matrix_specs(call, cfg)
    return make(call.a, *a), make(call.w, *b)


def slot_specs(call: GemmCall, descs, outs) -> tuple:
    """Per slot, (shape, strides, block) of a tile operand's (or a paired weight's)
    descriptor, or None. ``descs``: per slot, (shape, block[, transposed]) or None."""
    return tuple(
        None if d is None else (d[0], [leading_stride(v, len(d) > 2 and d[2]), 1], d[1])
        for d, v in zip(descs, call.inputs + tuple(outs))
    )


def _pair_desc(call: GemmCall, cfg: Config) -> tuple:
    """(shape, block, transposed) of a paired weight's descriptor: laid out as B."""
    _, (shape, _, block) = matrix_specs(call, cfg)
    return shape, block, call.b_t


def _k_part_desc(op, value, call: GemmCall, cfg: Config) -> tuple:
    """(shape, block, transposed) of a K part's descriptor: its A laid out as A, its
    weight as B, with its own K."""
    rows, k = value.shape
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if op.kind is Kind.K_PART_A:
        return ([k, rows], [bk, bm], True) if call.a_t else ([rows, k], [bm, bk], False)
    return ([k, rows], [bk, bn], True) if call.b_t else ([rows, k], [bn, bk], False)


def _tile_shape(op, call: GemmCall) -> list[int]:
    dims = call.out_dims(op) if op.kind in (Kind.TILE, Kind.TILE_PART) else None
    if dims is not None:
        return list(dims)
    return [call.M, call.N // 2 if op.kind is Kind.HALF_TILE else call.N]


def _m_part_desc(value, call: GemmCall, cfg: Config) -> tuple:
    """(shape, block, transposed) of a further A along M: laid out as A."""
    m, k = value.shape
    bm, bk = cfg.block_m, cfg.block_k
    return ([k, m], [bk, bm], True) if call.a_t else ([m, k], [bm, bk], False)


def _n_part_desc(value, call: GemmCall, cfg: Config) -> tuple:
    """(shape, block, transposed) of a further weight along N: laid out as B."""
    n, k = value.shape
    bn, bk = cfg.block_n, cfg.block_k
    return ([k, n], [bk, bn], True) if call.b_t else ([n, k], [bn, bk], False)


def slot_descs(call: GemmCall, cfg: Config, whole_seed: bool) -> tuple:
    """Per slot, (TMA shape, block) of a tile operand (a seed's block the whole tile with
    ``whole_seed``: the portable mainloop loads it at once), (shape, block, transposed) of
    a paired weight, or None."""
    values = call.inputs + (None,) * len(call.program.outputs)
    return tuple(
        (_tile_shape(op, call), tile_block(op, cfg, whole=whole_seed and op.kind is Kind.SEED))
        if op.is_tile or op.kind is Kind.TILE_PART
        else _pair_desc(call, cfg)
        if op.kind is Kind.PAIRED_WEIGHT
        else _k_part_desc(op, v, call, cfg)
        if op.kind in _K_PARTS
        else _n_part_desc(v, call, cfg)
        if op.kind is Kind.N_PART
        else _m_part_desc(v, call, cfg)
        if op.kind is Kind.M_PART
        else None
        for op, v in zip(call.program.slots, values)
    )  # fmt: skip


def stream_of(dev: torch.device) -> int:
    return torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0


def tail_counters(dev: torch.device, stream: int | None = None) -> torch.Tensor:
    """Per-tile arrival counters of the tail split, zero between launches (the last
    part of each tile resets its counter). One buffer per device and stream (default:
    the current one), so launches on different streams never share one; kept, so made
    outside any CUDA graph pool (``persistent.py``); inside a stream capture, made for
    that graph alone (its zeros written when it replays)."""
    key = (dev, stream_of(dev) if stream is None else stream)
    return kept(_COUNTERS, key, lambda: torch.zeros(1024, dtype=torch.int32, device=dev), dev)


def dummy(dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # stands in for the workspace and counters when no tile is split (never read; kept, so
    # made outside any CUDA graph pool, as tail_counters)
    return kept(_DUMMIES, (dev, dtype), lambda: torch.zeros(16, dtype=dtype, device=dev), dev)


_COUNTERS: dict = {}
_DUMMIES: dict = {}
