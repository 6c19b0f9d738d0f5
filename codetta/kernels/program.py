"""How an epilogue program is declared: a math-only body and its operands, by kind.

A program body is a ``@triton.jit`` function ``body(acc, *inputs) -> outputs``
over register tensors: ``acc`` is the fp32 accumulator (sub-)tile [BM, BNs]
and each input arrives already loaded, in the shape its kind says (below).
It returns its outputs in declared order (one output: the bare value). It
never loads, stores, masks or indexes: each mainloop (``mainloop.py``, the
portable Triton one; ``pingpong.py``, the sm_90 Gluon one) implements every
operand kind's loader and sink once, so the same body runs on both, and the
Triton interpreter checks on a CPU the very math the GPU runs.

Shapes are those of the GEMM output [M, N]; "row" means one of the M output
rows, "column" one of the N output columns.

Inputs (what the body receives for a [BM, BNs] sub-tile):
  ``Tile``       [M, N] tensor                     -> fp32 [BM, BNs]
  ``Tile(seeds_acc=True)``  [M, N], added to the accumulator before the K loop
                 (``acc = tile + A @ B^T``); the body does not receive it
  ``PerRow``     [M] vector, one value per row     -> fp32 [BM, 1] (int32 with ``index=True``)
  ``PerCol``     [N] vector, one value per column  -> fp32 [1, BNs]
  ``Scalar``     a Python float                    -> fp32 scalar
  ``DType``      nothing to pass: a zero scalar of the GEMM's element type, whose
                 ``.dtype`` a body rounds to (``x = acc.to(elem.dtype)``)
  ``RowTable(index=...)``  [P, W] table: row m reads table[index[m], n % W]
                 -> fp32 [BM, BNs] (RoPE's cos/sin by position)
  ``PairedWeight``  a second [N, K] weight, laid out as ``weight``: the mainloop
                 multiplies A by both (two accumulators, one A tile) and the body's
                 ``acc`` is the pair ``(a @ weight.T, a @ second.T)`` of [BM, BNs]
                 sub-tiles, e.g. gate and up for SwiGLU (the body does not receive
                 the weight itself). The portable mainloop keeps two accumulators
                 (no tail split); the ping-pong one stacks both weights' rows in one
                 B stage and forms both products with one wgmma (B not transposed)
  ``KPart`` (a pair of inputs, ``KPart("a1", "w1")``)  one more product summed into the
                 accumulator: ``acc = a @ weight.T + a1 @ w1.T + ...``, a1 [M, K_1] laid
                 out as ``a``, w1 [N, K_1] laid out as ``weight`` (a sum over operands
                 kept as their own tensors: the q/k/v projections' dX). Each part's K
                 loop runs after the previous one's, on both mainloops (no tail split)
  ``NPart``      a further [N_i, K] weight, laid out as ``weight``, whose output columns
                 follow the weight's: the GEMM's N is N_0 + N_1 + ... (column vectors
                 and reductions span it); each tile output comes back as one tensor per
                 weight ([M, N_0], [M, N_1], ...: the q, k and v projections from one
                 launch, each in its own tensor). Every boundary must be a multiple of
                 the tile width BLOCK_N (configurations that do not divide it are left
                 out); ``with_n_parts`` adds them (no tail split)
  ``MPart``      a further [M_i, K] A, laid out as ``a``, whose output rows follow a's:
                 the GEMM's M is M_0 + M_1 + ... (row vectors and tile inputs span it);
                 each tile output comes back as one tensor per A ([M_0, N], [M_1, N],
                 ...: the q, k and v weight gradients from one launch). Boundaries on
                 multiples of BLOCK_M; ``with_m_parts`` adds them (no tail split)
Outputs (what the body returns -> what the caller gets):
  ``Tile``       fp32 [BM, BNs] -> [M, N] (the GEMM's dtype unless ``dtype=``)
  ``HalfTile``   fp32 [BM, BNs/2] -> [M, N/2] (paired-column results: SwiGLU)
  ``RowSum``     fp32 [BM, BNs] -> fp32 [M], the sum over all N columns
  ``RowLogSumExp``  fp32 [BM, BNs] -> fp32 [M], log sum exp over all N columns
                 (``split=True``: fp32 [2, M], the sum rounded and its remainder)
  ``RowPick(index=...)``  fp32 [BM, BNs] -> fp32 [M], the value in column
                 index[m] (0 where index[m] is outside [0, N): e.g. ignore_index)
  ``ColSum``     fp32 [BM, BNs] -> fp32 [N], the sum over all M rows
Reductions are computed per sub-tile into a workspace and finished by a small
deterministic kernel (fixed order, no atomics), so the result's shape and bits
do not depend on the tile configuration beyond fp32 summation order.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import enum
import functools
import hashlib
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope

MAX_OPERANDS = 12  # kernel argument slots (mainloop.py, pingpong.py)


class Kind(enum.IntEnum):
    """Operand kinds; the numbers are the codes the mainloops dispatch on."""

    TILE = 1
    SEED = 2
    PER_ROW = 3
    PER_ROW_INDEX = 4
    PER_COL = 5
    SCALAR = 6
    DTYPE = 7
    ROW_TABLE = 8
    HALF_TILE = 9
    ROW_SUM = 10
    ROW_LSE = 11
    ROW_PICK = 12
    COL_SUM = 13
    PAIRED_WEIGHT = 14
    K_PART_A = 15
    K_PART_B = 16
    N_PART = 17
    TILE_PART = 18
    M_PART = 19


INPUT_KINDS = {Kind.TILE, Kind.SEED, Kind.PER_ROW, Kind.PER_ROW_INDEX, Kind.PER_COL, Kind.SCALAR,
               Kind.DTYPE, Kind.ROW_TABLE, Kind.PAIRED_WEIGHT, Kind.K_PART_A, Kind.K_PART_B,
               Kind.N_PART, Kind.M_PART}  # fmt: skip
OUTPUT_KINDS = {Kind.TILE, Kind.HALF_TILE, Kind.ROW_SUM, Kind.ROW_LSE, Kind.ROW_PICK, Kind.COL_SUM,
                Kind.TILE_PART}  # fmt: skip
REDUCTIONS = {Kind.ROW_SUM, Kind.ROW_LSE, Kind.ROW_PICK, Kind.COL_SUM}
TILE_KINDS = {Kind.TILE, Kind.SEED, Kind.HALF_TILE}  # passed to the kernels as TMA descriptors
# what the caller passes for each input kind (DType: nothing)
_CALLER_PASSES = {Kind.TILE: "[M, N]", Kind.SEED: "[M, N]", Kind.PER_ROW: "[M]", Kind.PER_ROW_INDEX: "[M]",
                  Kind.PER_COL: "[N]", Kind.SCALAR: "float", Kind.ROW_TABLE: "[P, W]",
                  Kind.PAIRED_WEIGHT: "[N, K]", Kind.K_PART_A: "[M, K_i]",
                  Kind.K_PART_B: "[N, K_i]", Kind.N_PART: "[N_i, K]", Kind.M_PART: "[M_i, K]"}  # fmt: skip


@dataclass(frozen=True)
class Operand:
    """One named operand. ``dtype``: of an output, None = the GEMM's dtype for tiles,
    float32 for reductions. ``index``: the PerRow index input a RowTable or RowPick reads."""

    name: str
    kind: Kind
    dtype: Any = None
    index: str | None = None
    split: bool = False  # a RowLogSumExp finished as (hi, lo) rows: fp32 [2, M]

    @property
    def is_tile(self) -> bool:
        return self.kind in TILE_KINDS


def Tile(name: str, *, seeds_acc: bool = False, dtype: torch.dtype | None = None) -> Operand:  # noqa: N802
    """An [M, N] tensor read or written at the tile's coordinates."""
    return Operand(name, Kind.SEED if seeds_acc else Kind.TILE, dtype)


def HalfTile(name: str, *, dtype: torch.dtype | None = None) -> Operand:  # noqa: N802
    """An [M, N/2] output: the body returns half as many columns as the accumulator."""
    return Operand(name, Kind.HALF_TILE, dtype)


def PerRow(name: str, *, index: bool = False) -> Operand:  # noqa: N802
    """An [M] input, one value per output row (``index=True``: integers, e.g. positions)."""
    return Operand(name, Kind.PER_ROW_INDEX if index else Kind.PER_ROW)


def PerCol(name: str) -> Operand:  # noqa: N802
    """An [N] input, one value per output column (e.g. a norm weight)."""
    return Operand(name, Kind.PER_COL)


def Scalar(name: str) -> Operand:  # noqa: N802
    """A Python float input."""
    return Operand(name, Kind.SCALAR)


def DType(name: str) -> Operand:  # noqa: N802
    """A zero scalar of the GEMM's element type: its ``.dtype`` rounds a value as the
    GEMM's outputs will store it (``acc.to(elem.dtype)``)."""
    return Operand(name, Kind.DTYPE)


def RowTable(name: str, *, index: str) -> Operand:  # noqa: N802
    """A [P, W] table; row m of the sub-tile reads table[index[m], n % W] (W divides N)."""
    return Operand(name, Kind.ROW_TABLE, index=index)


def PairedWeight(name: str) -> Operand:  # noqa: N802
    """A second [N, K] weight multiplied with the same A: the body's ``acc`` becomes the
    pair ``(a @ weight.T, a @ second.T)`` (e.g. SwiGLU's gate and up projections, each
    kept as its own tensor: no concatenation)."""
    return Operand(name, Kind.PAIRED_WEIGHT)


def KPart(a: str, w: str) -> tuple[Operand, Operand]:  # noqa: N802
    """One more product ``a @ w.T`` summed into the accumulator (two inputs: [M, K_i]
    laid out as the GEMM's A, [N, K_i] laid out as its weight); spread it into a
    program's inputs: ``inputs=(*KPart("a1", "w1"), ...)``."""
    return Operand(a, Kind.K_PART_A), Operand(w, Kind.K_PART_B)


def with_k_parts(program: Program, parts: int) -> Program:
    """``program`` over ``1 + parts`` products summed in its accumulator: the same body
    and outputs, inputs ``a1, w1, ..., a<parts>, w<parts>`` added (``KPart``)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    extra = tuple(op for i in range(1, parts + 1) for op in KPart(f"a{i}", f"w{i}"))
    ref = program.reference

    def reference(acc, **kw):  # the parts' products were added to acc already (launch._reference)
        return ref(acc, **{k: v for k, v in kw.items() if k not in {op.name for op in extra}})

    return dataclasses.replace(
        program, name=f"{program.name}_k{parts + 1}", inputs=program.inputs + extra,
        reference=None if ref is None else reference, tail_split=program.tail_split,
    )  # fmt: skip


def with_n_parts(program: Program, parts: int) -> Program:
    """``program`` over ``1 + parts`` weights side by side along N: inputs ``w1 ..
    w<parts>`` ([N_i, K], ``NPart``) added, and per tile output ``o`` the outputs ``o1 ..
    o<parts>`` (its columns of each further weight; ``o`` keeps the first weight's)."""
    return _with_parts(program, parts, Kind.N_PART, "w", "n")


def with_m_parts(program: Program, parts: int) -> Program:
    """``program`` over ``1 + parts`` A operands stacked along M: inputs ``a1 ..
    a<parts>`` ([M_i, K], ``MPart``) added, and per tile output ``o`` the outputs ``o1 ..
    o<parts>`` (its rows of each further A; ``o`` keeps the first A's)."""
    return _with_parts(program, parts, Kind.M_PART, "a", "m")


def _with_parts(program: Program, parts: int, kind, prefix: str, tag: str) -> Program:
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if any(op.kind is Kind.HALF_TILE for op in program.outputs):
        raise ValueError(f"program {program.name!r}: half-width outputs do not take M or N parts")
    extra_in = tuple(Operand(f"{prefix}{i}", kind) for i in range(1, parts + 1))
    extra_out = tuple(
        Operand(f"{op.name}{i}", Kind.TILE_PART, op.dtype, index=op.name)
        for op in program.outputs
        if op.kind is Kind.TILE
        for i in range(1, parts + 1)
    )
    return dataclasses.replace(
        program, name=f"{program.name}_{tag}{parts + 1}", inputs=program.inputs + extra_in,
        outputs=program.outputs + extra_out, tail_split=False,
    )  # fmt: skip


def RowSum(name: str) -> Operand:  # noqa: N802
    """fp32 [M]: the sum of the body's value over all N columns of each row."""
    return Operand(name, Kind.ROW_SUM)


def RowLogSumExp(name: str, *, split: bool = False) -> Operand:  # noqa: N802
    """fp32 [M]: log sum exp of the body's value over all N columns of each row.

    ``split=True``: fp32 [2, M], row 0 the log-sum-exp rounded to fp32 (hi), row 1 what
    that rounding left out (lo): hi + lo is the row's max + log sum exp(v - max) exactly,
    so its error is that of the small log term, not half an ulp of hi. A consumer forms
    exp(v - lse) as exp((v - hi) - lo), where v - hi is exact for the row's large values:
    the error of PyTorch's (v - max) - log(sum). (At |lse| ~ 64 one fp32 ulp is 7.6e-6,
    which every probability formed from hi alone would carry.)"""
    return Operand(name, Kind.ROW_LSE, split=split)


def RowPick(name: str, *, index: str) -> Operand:  # noqa: N802
    """fp32 [M]: the body's value in column index[m] of row m (0 if index[m] is not in [0, N))."""
    return Operand(name, Kind.ROW_PICK, index=index)


def ColSum(name: str) -> Operand:  # noqa: N802
    """fp32 [N]: the sum of the body's value over all M rows of each column."""
    return Operand(name, Kind.COL_SUM)


@dataclass(frozen=True)
class Program:
    """An epilogue program: a math-only ``body`` and its declared operands.

    ``reference(acc, **inputs) -> {output name: tensor}`` is the same math in
    PyTorch on the fp32 product ``acc`` [M, N] (seed added): the CPU path and
    the documentation of what the program computes; reductions come finished
    ([M] or [N]; a split RowLogSumExp as [M] in any dtype, float64 for its lo part, or
    as its [2, M] pair). ``check(M, N)`` raises ValueError for shapes the program
    cannot serve. ``configs`` overrides the Triton mainloop's candidate
    configurations (default: by the number of tile operands). ``layouts``: the
    (A transposed, B transposed) layouts the program is used with, for the
    sm_90a compile check. ``tail_split=False`` opts out of splitting a partial
    last wave along K. ``sm90_body``: an escape hatch, a Gluon-specific body
    with the same contract for the ping-pong mainloop (default: ``body``);
    ``pingpong=False`` keeps the program on the Triton mainloop; ``pingpong_configs``
    overrides its ping-pong candidates (default: by what its epilogue holds at once);
    ``pingpong_regs``: the registers per thread its second ping-pong consumer asks for
    (default ``pingpong.CONSUMER_REGS``, 232; the first consumer gets what the loader and
    the second leave of the 512 three warpgroups share), for an epilogue that spills
    in one consumer at the default split but not at an even one (240 / 248).
    ``stores_first``: the ping-pong mainloop stores a sub-tile's tile outputs before its
    reductions (default: the reductions first, which shrink their values to vectors
    before the stores): for a body whose reduced values are formed from its stored ones
    (CE_LOGITS_SCALED's l = r a), so the two are not held at once.
    ``sub_tile_width``: every epilogue sub-tile is exactly this many columns wide
    (and N a multiple of it): a body that works on one group of columns at a time,
    e.g. one attention head for RoPE's rotate-half; other configurations are left out.
    ``tuned_like``: another program whose tuned configurations stand in for this one's
    where its own shape is untuned (the nearest entry of that program, same candidates).
    """

    name: str
    body: Any
    inputs: tuple[Operand, ...] = ()
    outputs: tuple[Operand, ...] = ()
    reference: Callable[..., dict] | None = None
    check: Callable[[int, int], None] | None = None
    configs: tuple | None = None
    layouts: tuple = ((False, False),)
    tail_split: bool = True
    sm90_body: Any = None
    pingpong: bool = True
    sub_tile_width: int = 0
    pingpong_configs: tuple | None = None
    pingpong_regs: int = 0
    stores_first: bool = False
    result: type = field(init=False, repr=False, compare=False)
    # K parts: whether their summed K may be split in a tail all the same (the program allowed
    # a tail split before its parts turned it off; used with CODETTA_TAIL_LAUNCH=1)
    k_parts_tail: bool = False
    # a program whose tuned configurations serve this one's untuned shapes as the nearest
    # entries (the same tiles and mainloop with a little more epilogue: a bias's variant)
    tuned_like: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        where = f"program {self.name!r}"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a program's name must be an identifier, got {self.name!r}")
        if not hasattr(self.body, "fn") and not callable(self.body):
            raise TypeError(f"{where}: body must be a @triton.jit function")
        for op in self.inputs + self.outputs:
            if not isinstance(op, Operand):
                raise TypeError(f"{where}: operands are made by Tile(), PerRow(), ... not {op!r}")
        like = self.tuned_like
        if like is not None and (not isinstance(like, Program) or like.sub_tile_width != self.sub_tile_width):
            raise ValueError(f"{where}: tuned_like must be a Program with the same sub_tile_width")
        if self.pingpong_regs and not (self.pingpong_regs % 8 == 0 and 232 <= self.pingpong_regs <= 256):
            raise ValueError(
                f"{where}: pingpong_regs must be a multiple of 8 in [232, 256], got {self.pingpong_regs}"
            )
        names = [op.name for op in self.inputs + self.outputs]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: operand names repeat: {names}")
        for op in self.inputs:
            if op.kind not in INPUT_KINDS:
                raise ValueError(f"{where}: input {op.name!r} cannot be {op.kind.name}")
        for op in self.outputs:
            if op.kind not in OUTPUT_KINDS:
                raise ValueError(f"{where}: output {op.name!r} cannot be {op.kind.name}")
        if sum(op.kind is Kind.SEED for op in self.inputs) > 1:
            raise ValueError(f"{where}: at most one input seeds the accumulator")
        paired = sum(op.kind is Kind.PAIRED_WEIGHT for op in self.inputs)
        if paired > 1 or (paired and any(op.kind is Kind.SEED for op in self.inputs)):
            raise ValueError(f"{where}: at most one PairedWeight, and not with a seeded accumulator")
        parts = [op for op in self.inputs if op.kind in (Kind.K_PART_A, Kind.K_PART_B)]
        kinds = [op.kind for op in parts]
        if kinds != [Kind.K_PART_A, Kind.K_PART_B] * (len(kinds) // 2):
            raise ValueError(f"{where}: K parts come in (A, weight) pairs, made by KPart()")
        if parts and paired:
            raise ValueError(f"{where}: K parts and a PairedWeight do not mix")
        if parts:
            # each part's K loop runs whole, unless CODETTA_TAIL_LAUNCH=1 (engines.tail_allowed)
            object.__setattr__(self, "k_parts_tail", self.tail_split or self.k_parts_tail)
            object.__setattr__(self, "tail_split", False)
        n_only = sum(op.kind is Kind.N_PART for op in self.inputs)
        m_only = sum(op.kind is Kind.M_PART for op in self.inputs)
        if (n_only or m_only) and (paired or parts or (n_only and m_only)):
            raise ValueError(f"{where}: M or N parts mix with no other parts and no PairedWeight")
        n_parts = n_only + m_only
        tiles = [op.name for op in self.outputs if op.kind is Kind.TILE]
        for op in self.outputs:
            if op.kind is Kind.TILE_PART and op.index not in tiles:
                raise ValueError(f"{where}: {op.name!r} is a part of {op.index!r}, not a Tile output")
        for name in tiles:
            per = sum(op.index == name for op in self.outputs if op.kind is Kind.TILE_PART)
            if n_parts and per != n_parts:
                raise ValueError(f"{where}: tile output {name!r} needs one part per M or N part ({n_parts})")
        if not n_parts and any(op.kind is Kind.TILE_PART for op in self.outputs):
            raise ValueError(f"{where}: tile output parts without MPart or NPart inputs")
        if n_parts:
            object.__setattr__(self, "tail_split", False)
        if paired:
            # two products of each tile: whole tiles on the portable mainloop (no K-split
            # tail); on the ping-pong mainloop one accumulator holds both side by side
            object.__setattr__(self, "tail_split", False)
        index_inputs = {op.name for op in self.inputs if op.kind is Kind.PER_ROW_INDEX}
        for op in self.inputs + self.outputs:
            if op.kind in (Kind.ROW_TABLE, Kind.ROW_PICK) and op.index not in index_inputs:
                raise ValueError(
                    f"{where}: {op.name!r} reads index {op.index!r}, which is not a PerRow(index=True) input"
                )
        if not self.outputs:
            raise ValueError(f"{where} has no outputs")
        slots = [op for op in self.inputs + self.outputs if op.kind is not Kind.DTYPE]
        if len(slots) > MAX_OPERANDS:
            raise ValueError(f"{where}: at most {MAX_OPERANDS} operands, got {len(slots)}")
        result = collections.namedtuple(f"{self.name}_result", [op.name for op in self.outputs])
        object.__setattr__(self, "result", result)

    # ---- what the mainloops need, derived once

    @functools.cached_property
    def source_key(self) -> str:
        """A hash of the body's code (and the sm90 body's), with the JIT helpers they call
        (by name or through one of codetta's modules, ``P.rounded``; theirs in turn),
        docstrings, comments and layout left out (``_code_of``): the
        same whether or not the interpreter is on, so tuning keys (``tuning.Chooser.key``)
        made on a CPU match a GPU's, and a documentation edit keeps a body's tuned entries.
        ``stores_first`` is hashed in too: the same math in another kernel, whose configs
        time (and spill) otherwise, so entries tuned under the other order are not taken."""
        key = _source_hash(self.body, self.sm90_body)
        if self.stores_first:
            key = hashlib.sha256(f"{key}|stores_first".encode()).hexdigest()[:10]
        return key

    @functools.cached_property
    def caller_inputs(self) -> tuple[Operand, ...]:
        """The inputs a caller passes (all but DType)."""
        return tuple(op for op in self.inputs if op.kind is not Kind.DTYPE)

    @functools.cached_property
    def slots(self) -> tuple[Operand, ...]:
        """Operands in kernel-slot order: the caller's inputs, then the outputs."""
        return self.caller_inputs + self.outputs

    @functools.cached_property
    def seed_slot(self) -> int:
        """Slot of the accumulator-seeding tile, or -1."""
        return next((i for i, op in enumerate(self.slots) if op.kind is Kind.SEED), -1)

    @functools.cached_property
    def pair_slot(self) -> int:
        """Slot of the paired weight, or -1."""
        return next((i for i, op in enumerate(self.slots) if op.kind is Kind.PAIRED_WEIGHT), -1)

    @functools.cached_property
    def k_parts(self) -> tuple:
        """Per extra K part, the slots of its (A, weight) pair."""
        a = [i for i, op in enumerate(self.slots) if op.kind is Kind.K_PART_A]
        w = [i for i, op in enumerate(self.slots) if op.kind is Kind.K_PART_B]
        return tuple(zip(a, w))

    @functools.cached_property
    def n_parts(self) -> tuple:
        """Slots of the further weights along N (NPart), in order."""
        return tuple(i for i, op in enumerate(self.slots) if op.kind is Kind.N_PART)

    @functools.cached_property
    def m_parts(self) -> tuple:
        """Slots of the further A operands along M (MPart), in order."""
        return tuple(i for i, op in enumerate(self.slots) if op.kind is Kind.M_PART)

    @functools.cached_property
    def out_parts(self) -> tuple:
        """Per output the body returns, the slots of its parts (one per NPart weight; ()
        for a program without N parts)."""
        if not self.n_parts and not self.m_parts:
            return ()
        names = [op.name for op in self.slots]
        part = Kind.TILE_PART
        return tuple(
            tuple(names.index(p.name) for p in self.outputs if p.kind is part and p.index == op.name)
            for op in self.outputs
            if op.kind is not part
        )

    @functools.cached_property
    def part_number(self) -> dict:
        """Output name -> which weight's columns it holds (0: the first weight's)."""
        out, seen = {}, {}
        for op in self.outputs:
            if op.kind is Kind.TILE_PART:
                seen[op.index] = seen.get(op.index, 0) + 1
                out[op.name] = seen[op.index]
            else:
                out[op.name] = 0
        return out

    @functools.cached_property
    def in_kinds(self) -> tuple:
        """Per declared input (DType included): (kind code, slot, index slot, 0); a
        RowTable's last field is its table width, filled in per call."""
        names = [op.name for op in self.slots]
        return tuple(
            (
                int(op.kind),
                -1 if op.kind is Kind.DTYPE else names.index(op.name),
                names.index(op.index) if op.index is not None else -1,
                0,
            )
            for op in self.inputs
        )

    @functools.cached_property
    def out_kinds(self) -> tuple:
        """Per output the body returns (not the N parts' outputs: ``out_parts``): (kind
        code, slot, index slot, its place among the tile outputs, their number)."""
        names = [op.name for op in self.slots]
        tiles = [op.name for op in self.outputs if op.is_tile]
        return tuple(
            (
                int(op.kind),
                names.index(op.name),
                names.index(op.index) if op.index else -1,
                tiles.index(op.name) if op.is_tile else -1,
                len(tiles),
            )
            for op in self.outputs
            if op.kind is not Kind.TILE_PART
        )

    def __hash__(self):
        return hash(self.name)


@triton.jit
def _store(acc):
    """out = acc."""
    return acc


# the plain product: the default program, and the one every mainloop is checked with
STORE = Program("store", _store, outputs=(Tile("out"),), reference=lambda acc: {"out": acc})


@dataclass(frozen=True)
class Layout:
    """The tile geometry of a launch: what its reduction workspaces are shaped by."""

    block_m: int
    block_n: int
    sub_n: int


def _code_of(source: str) -> str:
    """A function's code without its docstrings, comments and layout (the source parsed
    and printed back): what a kernel compiles from, so editing a body's documentation
    keeps its tuned entries."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _source_hash(*fns) -> str:
    seen, parts = set(), []

    def visit(f):
        py = getattr(f, "fn", f)
        if not callable(py) or py in seen or not hasattr(py, "__code__"):
            return
        seen.add(py)
        try:
            parts.append(_code_of(inspect.getsource(py)))
        except (OSError, TypeError):
            parts.append(py.__qualname__)
        names = py.__code__.co_names
        for name in names:
            g = py.__globals__.get(name)
            if isinstance(g, types.ModuleType) and g.__name__.split(".")[0] == "codetta":
                # a helper reached through one of codetta's modules (``P.rounded``): the
                # attribute's name is among co_names too (a name the body uses otherwise
                # may match a helper of that module: hashed too, harmless)
                for attr in names:
                    h = getattr(g, attr, None)
                    if h is not None and hasattr(h, "fn") and hasattr(h.fn, "__code__"):
                        visit(h)
            elif g is not None and hasattr(g, "fn") and hasattr(g.fn, "__code__"):
                visit(g)  # a JIT helper the body calls

    for fn in fns:
        if fn is not None:
            visit(fn)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]


def caller_shape(op: Operand) -> str:
    """What a caller passes for this input, for error messages."""
    return _CALLER_PASSES[op.kind]
