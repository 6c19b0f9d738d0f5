"""How an epilogue program is declared to the launcher.

An :class:`Epilogue` names its Triton functions and its operands. The launcher
validates the operands a caller passes, allocates the outputs, builds TMA
descriptors for tile operands and hands the kernel one tuple ``ops``: the
inputs in declared order, then the outputs in declared order.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import primitives
from .mainloop import MAX_OPERANDS


class Kind(enum.Enum):
    """Shape of an operand, in terms of the GEMM output [M, N]."""

    TILE = "tile"  # [M, N], read or written at the tile's coordinates (TMA)
    ROW = "row"  # [N], one value per output column (broadcast over rows)
    COL = "col"  # [M], one value per output row (broadcast over columns)
    SCALAR = "scalar"  # a Python float or int
    ROW_PARTIAL = "row_partial"  # out: fp32 [M, cdiv(N, sub-tile width)]
    TILE_ROW_PARTIAL = "tile_row_partial"  # out: fp32 [M, cdiv(N, BLOCK_N)]
    COL_PARTIAL = "col_partial"  # out: fp32 [cdiv(M, BLOCK_M), N]


INPUT_KINDS = (Kind.TILE, Kind.ROW, Kind.COL, Kind.SCALAR)
OUTPUT_KINDS = (Kind.TILE, Kind.COL, Kind.ROW_PARTIAL, Kind.TILE_ROW_PARTIAL, Kind.COL_PARTIAL)


@dataclass(frozen=True)
class Operand:
    """One named operand. ``dtype`` of an output: None = the GEMM's input dtype
    for tiles, float32 for everything else; or a ``torch.dtype``."""

    name: str
    kind: Kind
    dtype: Any = None


@dataclass(frozen=True)
class Layout:
    """The tile geometry a launch used; references need it to lay out partials."""

    block_m: int
    block_n: int
    sub_n: int


@dataclass(frozen=True)
class Epilogue:
    """An epilogue program.

    ``apply(acc, off_m, off_n, M, N, ops, state) -> state`` runs on each fp32
    sub-tile; ``init(BLOCK_M) -> state`` before a tile's first sub-tile;
    ``finish(state, off_m, off_n, M, N, ops, BLOCK_N)`` after its last.
    ``reference(acc, layout, **inputs) -> {output name: tensor}`` is the same
    math in PyTorch on the fp32 product ``acc`` [M, N]: the CPU path and the
    documentation of what the program stores. ``configs`` overrides the GPU
    configurations the tuner tries (default: by the number of tile operands).
    ``check(M, N)`` raises ValueError for output shapes the program cannot serve.
    ``acc_init`` names a tile input that seeds the accumulator (``acc = init +
    A @ B^T``, like a GEMM's beta = 1): it is read once per tile, before the
    K loop, and costs the epilogue nothing; ``apply`` and ``reference`` then
    see the sum. ``layouts`` lists the (A transposed, B transposed) layouts
    the program is used with, for the sm_90a compile check. ``tail_split``:
    whether the tiles of a partial last wave may be split along K
    (``mainloop.py``); the launcher already runs a configuration unsplit when
    its tail path would spill registers, so False is only an opt-out.
    ``sm90``: the same program as a Gluon function for the sm_90 ping-pong
    mainloop (``pingpong.py``), ``sm90(acc, buf, off_m, off_n, M, N, ops)`` on the
    whole tile; with it the tuner also tries that mainloop on Hopper GPUs.
    """

    name: str
    apply: Any
    inputs: tuple[Operand, ...] = ()
    outputs: tuple[Operand, ...] = ()
    reference: Callable[..., dict] | None = None
    init: Any = primitives.no_state
    finish: Any = primitives.no_finish
    configs: tuple | None = None
    check: Callable[[int, int], None] | None = None
    acc_init: str | None = None
    layouts: tuple = ((False, False),)
    tail_split: bool = True
    sm90: Any = None
    result: type = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"epilogue name must be an identifier, got {self.name!r}")
        names = [op.name for op in self.inputs + self.outputs]
        if len(set(names)) != len(names):
            raise ValueError(f"epilogue {self.name!r}: operand names repeat: {names}")
        for op in self.inputs:
            if op.kind not in INPUT_KINDS:
                raise ValueError(f"epilogue {self.name!r}: input {op.name!r} cannot be {op.kind}")
        for op in self.outputs:
            if op.kind not in OUTPUT_KINDS:
                raise ValueError(f"epilogue {self.name!r}: output {op.name!r} cannot be {op.kind}")
        if len(names) > MAX_OPERANDS:
            raise ValueError(f"epilogue {self.name!r}: at most {MAX_OPERANDS} operands, got {len(names)}")
        if self.acc_init is not None and self.acc_init not in [
            op.name for op in self.inputs if op.kind is Kind.TILE
        ]:
            raise ValueError(f"epilogue {self.name!r}: acc_init {self.acc_init!r} is not a tile input")
        if not self.outputs:
            raise ValueError(f"epilogue {self.name!r} has no outputs")
        result = collections.namedtuple(f"{self.name}_result", [op.name for op in self.outputs])
        object.__setattr__(self, "result", result)

    @property
    def acc_init_index(self) -> int:
        """Position of the accumulator-seeding operand in ``ops``, or -1."""
        names = [op.name for op in self.inputs]
        return names.index(self.acc_init) if self.acc_init is not None else -1

    def __hash__(self):
        return hash(self.name)
