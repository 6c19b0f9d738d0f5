"""The two mainloops as host-side objects: their candidate configurations, kernel
signatures, constexprs and descriptors, built in one place for both a launch and
the ahead-of-time sm_90a compile check (``aot.py``).

``TRITON`` (``mainloop.py``) runs every program everywhere, the interpreter
included; ``PINGPONG`` (``pingpong.py``) runs bf16/fp16 programs on sm_90 GPUs.
Operand slots carry, in the program's slot order: a TMA descriptor per tile
operand, a pointer per vector, table or reduction workspace, a float per scalar
(their shapes and blocks: ``descriptors.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from . import configs, device, pingpong
from .configs import Config
from .descriptors import (
    cdiv,
    dummy,
    matrix_descs,
    matrix_specs,
    slot_descs,
    slot_dtype,
    slot_specs,
    tail_counters,
    tile_block,
    tma_desc,
)
from .direct import DirectKernel
from .mainloop import gemm_kernel
from .memo import Memo
from .operands import GemmCall
from .program import MAX_OPERANDS, Kind, Program
from .settings import SETTINGS

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
       torch.int64: "i64"}  # fmt: skip
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_GL_RING_DTYPES = {**_GL_DTYPES, torch.float32: gl.float32}


@dataclass(frozen=True)
class _Plan:
    cfg: Config  # the config the launch runs (a spilling tail split turned off)
    descs: tuple  # per slot: (TMA shape, block) of a tile operand, or None
    grid: int
    splits: int  # K parts of each tail tile (1: no tail split)
    ws_numel: int  # fp32 elements of the tail split's partial tiles
    consts: dict
    tail: TailLaunch | None = None  # a tail split as a launch of its own, after this one's


def _spill_key(call: GemmCall, cfg: Config) -> tuple:
    """What a tail-split kernel's register spills depend on (not the shapes): the key of
    the engines' spill verdicts, read once per config."""
    return (call.program, cfg, call.dtype, call.a_t, call.b_t, call.device)


class TritonEngine:
    """The portable persistent mainloop (``mainloop.py``)."""

    name = "triton"

    def __init__(self):
        # (program, config, dtype, layout, device) whose tail-split kernel spills registers,
        # and those whose verdict is known (read once, from the first real launch's kernel)
        self._tail_spills: set = set()
        self._spills_read: set = set()
        # (keyed on call shapes: bounded, ``memo.py``)
        self._plans = Memo()  # launch plans, built once per (call shape, config)
        self._tail_kernels = Memo()  # (call, TailLaunch) -> the tail launch's kernel (for bind_tail)

    def candidates(self, program: Program) -> list[Config]:
        if program.configs is not None:
            cfgs = list(program.configs)
        else:
            n_tiles = sum(op.is_tile for op in program.slots)
            cfgs = list(configs.PLAIN_CANDIDATES if n_tiles <= 1 else configs.STREAMING_CANDIDATES)
        if not tail_allowed(program):
            cfgs = list(dict.fromkeys(dataclasses.replace(c, tail_split=1) for c in cfgs))
        return fitting_sub_tiles(program, cfgs)

    def unsupported(self, call: GemmCall) -> str | None:
        return None

    def constexprs(self, program: Program, in_kinds, cfg: Config, dtype, a_t, b_t, num_sms) -> dict:
        return {
            "NUM_OPS": len(program.slots), "SEED": program.seed_slot, "PAIR": program.pair_slot,
            "KPARTS": program.k_parts, "NPARTS": program.n_parts, "MPARTS": program.m_parts,
            "OUT_PARTS": program.out_parts, "BODY": program.body,
            "IN_KINDS": in_kinds, "OUT_KINDS": program.out_kinds, "A_T": a_t, "B_T": b_t,
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m, "EPI_SPLIT": cfg.epi_split, "NUM_SMS": num_sms,
            "FLATTEN": cfg.flatten, "WARP_SPECIALIZE": cfg.warp_specialize,
            "IEEE": dtype == torch.float32, "TAIL_SPLIT": cfg.tail_split, "TAIL_ONLY": False,
            "MAIN_ONLY": False,
        }  # fmt: skip

    def signature(self, program: Program, cfg: Config, dtype, a_t: bool, b_t: bool) -> dict:
        """Argument types for the ahead-of-time compile (constexprs excluded)."""
        t = _TY[dtype]
        a_block = [cfg.block_k, cfg.block_m] if a_t else [cfg.block_m, cfg.block_k]
        b_block = [cfg.block_k, cfg.block_n] if b_t else [cfg.block_n, cfg.block_k]
        sig = {
            "a_desc": f"tensordesc<{t}[{a_block[0]}, {a_block[1]}]>",
            "b_desc": f"tensordesc<{t}[{b_block[0]}, {b_block[1]}]>",
            "M": "i32", "N": "i32", "K": "i32",
        }  # fmt: skip
        for i, op in enumerate(program.slots):
            block = (
                b_block if op.kind in (Kind.PAIRED_WEIGHT, Kind.K_PART_B, Kind.N_PART)
                else a_block if op.kind in (Kind.K_PART_A, Kind.M_PART)
                else tile_block(op, cfg, whole=op.kind is Kind.SEED)
            )  # fmt: skip
            sig[f"o{i}"] = _slot_type(op, dtype, block)
        for i in range(len(program.slots), MAX_OPERANDS):
            sig[f"o{i}"] = "constexpr"
        sig.update({"ws_ptr": "*fp32", "counts_ptr": "*i32", "tail_splits": "i32"})
        return sig

    def _plan(self, call: GemmCall, cfg: Config) -> _Plan:
        """Everything about a launch that depends on shapes and the config, not on the tensors."""
        program, M, N = call.program, call.M, call.N
        spill_key = _spill_key(call, cfg)
        if cfg.tail_split > 1 and (spill_key in self._tail_spills or not tail_allowed(program)):
            cfg = dataclasses.replace(cfg, tail_split=1)
        interp = device.interpreting()
        num_sms = (
            configs.INTERPRETER_NUM_SMS if interp else device.grid_sms(call.device.index or 0) * cfg.occupancy
        )
        tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        min_k = 1 if interp else configs.MIN_K_BLOCKS_PER_PART
        k_blocks = cdiv(call.k_total, cfg.block_k)  # (K parts: their summed K)
        splits = configs.tail_splits(cfg, tiles, num_sms, k_blocks, min_k, SETTINGS.tail_split)
        tail = tiles % num_sms
        own = None
        if splits < 2 and SETTINGS.tail_launch and SETTINGS.tail_split and cfg.tail_split > 1:
            # a tail too large to split within the launch (tail x 2 > grid): the launch runs
            # the rest (MAIN_ONLY), then a launch of its own the tail, split (TAIL_ONLY)
            own = own_launch_tail(cfg, tiles, num_sms, k_blocks, cfg)
        if own is not None:
            consts = self.constexprs(program, call.in_kinds, cfg, call.dtype, call.a_t, call.b_t, num_sms)
            consts["MAIN_ONLY"] = True
            return _Plan(cfg=cfg, descs=slot_descs(call, cfg, whole_seed=True), grid=num_sms,
                         splits=own.splits, ws_numel=0, consts=consts, tail=own)  # fmt: skip
        grid = min(num_sms, max(tiles, tail * splits)) if splits > 1 else min(num_sms, tiles)
        return _Plan(
            cfg=cfg,
            descs=slot_descs(call, cfg, whole_seed=True),
            grid=grid,
            splits=splits,
            ws_numel=tail * splits * cfg.block_m * cfg.block_n if splits > 1 else 0,  # fp32 partial tiles
            consts=self.constexprs(program, call.in_kinds, cfg, call.dtype, call.a_t, call.b_t, num_sms),
        )

    def launch_plan(self, call: GemmCall, cfg: Config) -> _Plan:
        """The plan a launch of the call with this config runs (built once, cached)."""
        key = self._plan_key(call, cfg)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(call, cfg)
        return plan

    @staticmethod
    def _plan_key(call: GemmCall, cfg: Config) -> tuple:
        # (the inputs' shapes too: the plan's descriptors are shaped by the K, N and M parts,
        # which M, N and the first K do not fix)
        shapes = tuple(v.shape for v in call.inputs if isinstance(v, torch.Tensor))
        return (call.program, call.in_kinds, cfg, call.dtype, call.a_t, call.b_t, call.M, call.N, call.K,
                shapes, call.device, SETTINGS.tail_split, SETTINGS.tail_launch,
                device.sm_margin())  # fmt: skip

    def launch(self, call: GemmCall, cfg: Config, outs: list, warmup: bool = False):
        """Run the call with this configuration (``warmup``: only compile it); returns
        the compiled kernel (None when interpreted)."""
        plan = self.launch_plan(call, cfg)
        if not warmup and plan.cfg.tail_split > 1 and not device.interpreting():
            # a program that leaves no registers for the tail path (its split kernel
            # spills) runs this config unsplit: decided once per config (not per token
            # count) from the compiled kernel before the first real launch, so every call of
            # every shape sums K in one order for the whole run, a plan forgotten and built
            # again included (a shape's first call ran split once, and its results differed
            # by a rounding). (Not on a warmup: the tuner's concurrent compiles get futures,
            # not kernels.)
            spill_key = _spill_key(call, cfg)
            if spill_key not in self._spills_read:
                self._spills_read.add(spill_key)
                split = self.launch_tail(call, plan.tail, outs, warmup=True) if plan.tail else None
                if _spills(split if plan.tail else self._run(call, plan, outs, warmup=True)):
                    self._tail_spills.add(spill_key)
            if spill_key in self._tail_spills:  # (a plan built before the verdict)
                plan = self._plans[self._plan_key(call, cfg)] = self._plan(call, cfg)
        kernel = self._run(call, plan, outs, warmup)
        if plan.tail is not None:
            self.launch_tail(call, plan.tail, outs, warmup)
        return kernel

    def _run(self, call: GemmCall, plan, outs: list, warmup: bool):
        a_desc, b_desc = matrix_descs(tma_desc, call, plan.cfg)
        specs = slot_specs(call, plan.descs, outs)
        slots = [v if d is None else tma_desc(v, *d) for d, v in zip(specs, (*call.inputs, *outs))]
        slots += [None] * (MAX_OPERANDS - len(slots))
        if plan.splits > 1:
            ws = torch.empty(plan.ws_numel, dtype=torch.float32, device=call.device)
            counts = tail_counters(call.device)
        else:
            ws, counts = dummy(call.device, torch.float32), dummy(call.device, torch.int32)
        c = plan.cfg
        with device.on_device(call.device):
            return gemm_kernel.run(
                a_desc, b_desc, call.M, call.N, call.K, *slots, ws, counts, plan.splits, **plan.consts,
                grid=(plan.grid,), warmup=warmup, num_warps=c.num_warps, num_stages=c.num_stages,
            )  # fmt: skip

    def _tail_plan(self, call: GemmCall, tail) -> _Plan:
        """The portable launch of a split tail (``TailLaunch``: a ping-pong launch's, or a
        MAIN_ONLY portable launch's)."""
        cfg = tail.cfg
        consts = self.constexprs(call.program, call.in_kinds, cfg, call.dtype, call.a_t, call.b_t, tail.grid)
        consts["TAIL_ONLY"] = True
        return _Plan(cfg=cfg, descs=slot_descs(call, cfg, whole_seed=True), grid=tail.tail * tail.splits,
                     splits=tail.splits, ws_numel=tail.tail * tail.splits * cfg.block_m * cfg.block_n,
                     consts=consts)  # fmt: skip

    @staticmethod
    def _tail_key(call: GemmCall, tail) -> tuple:
        return (call.program, call.in_kinds, call.dtype, call.a_t, call.b_t, call.M, call.N, call.K,
                call.device, tail)  # fmt: skip

    def launch_tail(self, call: GemmCall, tail, outs: list, warmup: bool = False):
        """Run (``warmup``: compile) only the split tail tiles (``TailLaunch``) of a launch
        that ran the rest; a real launch's kernel is kept for ``bind_tail``."""
        kernel = self._run(call, self._tail_plan(call, tail), outs, warmup)
        if not warmup:
            self._tail_kernels[self._tail_key(call, tail)] = kernel
        return kernel

    def bind_tail(self, call: GemmCall, tail, outs: list):
        """``bind`` for ``launch_tail``: None until a real tail launch compiled its kernel."""
        kernel = self._tail_kernels.get(self._tail_key(call, tail))
        return None if kernel is None else self._bind_plan(call, self._tail_plan(call, tail), outs, kernel)

    def bind(self, call: GemmCall, cfg: Config, outs: list, compiled):
        """A launcher for later calls of this exact signature (shapes, strides, dtypes,
        alignment) that skips the JIT's per-call binding: ``fn(a, w, inputs, outs, stream)``.
        None where this launch's plan is not final (a tail split that spilled)."""
        plan = self._plans.get(self._plan_key(call, cfg))
        if plan is None or compiled is None:
            return None
        main = self._bind_plan(call, plan, outs, compiled)
        if plan.tail is None:
            return main
        tail = self.bind_tail(call, plan.tail, outs)
        if tail is None:
            return None

        def run(a, w, inputs, outs, stream):
            main(a, w, inputs, outs, stream)
            tail(a, w, inputs, outs, stream)

        return run

    def _bind_plan(self, call: GemmCall, plan: _Plan, outs: list, compiled):
        kernel = DirectKernel(gemm_kernel, compiled, 20, plan.consts, plan.grid)
        a_spec, b_spec = matrix_specs(call, plan.cfg)
        specs = slot_specs(call, plan.descs, outs)
        pad = (None,) * (MAX_OPERANDS - len(specs))
        M, N, K, splits, ws_numel, dev = call.M, call.N, call.K, plan.splits, plan.ws_numel, call.device
        dummies = dummy(dev, torch.float32), dummy(dev, torch.int32)

        def run(a, w, inputs, outs, stream):
            slots = [v if d is None else tma_desc(v, *d) for d, v in zip(specs, (*inputs, *outs))]
            if splits > 1:
                ws = torch.empty(ws_numel, dtype=torch.float32, device=dev)
                extra = (ws, tail_counters(dev, stream), splits)
            else:
                extra = (*dummies, splits)
            kernel(stream, tma_desc(a, *a_spec), tma_desc(w, *b_spec), M, N, K, *slots, *pad, *extra)

        return run


def tail_allowed(program: Program) -> bool:
    """Whether the program's last partial wave may be split along K: its own choice, and
    for K parts (whose summed K the split then divides) only with ``CODETTA_TAIL_LAUNCH=1``
    (GPU-tested, run 101)."""
    return program.tail_split or (SETTINGS.tail_launch and program.k_parts_tail)


def fitting_sub_tiles(program: Program, cfgs) -> list[Config]:
    """The configurations whose epilogue sub-tiles are exactly the program's
    ``sub_tile_width`` wide (all of them when it asks for none)."""
    w = program.sub_tile_width
    return [c for c in cfgs if not w or c.sub_n == w]


def _in_tiles(program: Program) -> tuple:
    """Slots of the non-seeding tile inputs."""
    return tuple(i for i, op in enumerate(program.caller_inputs) if op.kind is Kind.TILE)


def _slot_type(op, dtype, block) -> str:
    if op.is_tile or op.kind in (
        Kind.PAIRED_WEIGHT,
        Kind.N_PART,
        Kind.M_PART,
        Kind.TILE_PART,
        Kind.K_PART_A,
        Kind.K_PART_B,
    ):
        return f"tensordesc<{_TY[slot_dtype(op, dtype)]}[{block[0]}, {block[1]}]>"
    if op.kind is Kind.SCALAR:
        return "fp32"
    return "*" + _TY[slot_dtype(op, dtype)]


@functools.cache
def _gl_layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_RING_DTYPES[dtype])


def _gl_desc(t: torch.Tensor, shape, strides, block):
    return tma_desc(t, shape, strides, block, _gl_layout(tuple(block), t.dtype))


def _fits_ring(op, value, ring: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a tile operand (its tensor ``value``, None for an output) can move through
    a ring of ``ring``: in its dtype, or an output of a narrower dtype stored through a
    ring slot viewed in that dtype (a float32 ring's output in the GEMM's dtype)."""
    want = op.dtype or dtype
    if value is not None and value.dtype != want:
        return False
    return want == ring or (value is None and ring == torch.float32 and want.itemsize < 4)


class PingPongEngine:
    """The warp-specialized sm_90 mainloop (``pingpong.py``), bf16/fp16 only."""

    name = "pingpong"

    def __init__(self):
        self._consts: dict = {}  # constexpr dicts, built once per kernel variant
        self._tail_spills: set = set()  # (program, config, dtype, layout, device): tail kernel spills
        self._spills_read: set = set()  # those whose verdict is known (read once, TritonEngine's way)

    @staticmethod
    def ring_dtype(program: Program, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the epilogue ring: that of every tile operand when they all
        declare one (float32: a weight gradient summed in place); float32 too when every
        tile input declares it and the outputs are float32 or the GEMM's dtype (a float32
        sum finished in the GEMM's dtype, ``FINISH_F32``: the narrower output is stored
        through a ring slot viewed in its dtype, ``pingpong._store_tiles``); else the GEMM's."""
        declared = {op.dtype for op in program.slots if op.is_tile}
        if len(declared) == 1 and None not in declared:
            return declared.pop()
        ins = {op.dtype for op in program.inputs if op.is_tile}
        outs = {op.dtype for op in program.outputs if op.is_tile}
        if ins == {torch.float32} and outs <= {torch.float32, None}:
            return torch.float32
        return dtype

    def candidates(self, program: Program) -> list[Config]:
        if not program.pingpong:
            return []
        if program.pingpong_configs is not None:
            return fitting_sub_tiles(program, self._with_tail(program, program.pingpong_configs))
        if self.ring_dtype(program, None) == torch.float32:
            cands = configs.PINGPONG_F32_RING_CANDIDATES
            cfgs = [c for c in cands if self.ring_fits(program, c, torch.bfloat16)]
            return fitting_sub_tiles(program, self._with_tail(program, cfgs))
        if program.pair_slot >= 0:
            return fitting_sub_tiles(program, configs.PINGPONG_PAIRED_CANDIDATES)
        # the tile-shaped values the epilogue holds at once: loaded tiles and the body's outputs
        loads = sum(op.kind is Kind.TILE for op in program.caller_inputs)
        # a gathered element (RowPick) adds its column match over the tile
        outs = [op for op in program.outputs if op.kind is not Kind.TILE_PART]  # (parts: one store per tile)
        held = loads + len(outs) + sum(op.kind is Kind.ROW_PICK for op in outs)
        if loads >= 2 or held >= 4:
            cfgs = configs.PINGPONG_HEAVY_CANDIDATES
        elif held >= 3:
            cfgs = configs.PINGPONG_STREAMING_CANDIDATES
        else:
            cfgs = configs.PINGPONG_CANDIDATES
        if loads:  # the tile inputs' prefetch buffer fits beside 4 A/B stages, not 5
            four = (dataclasses.replace(c, num_stages=4) for c in cfgs)
            cfgs = cfgs + tuple(c for c in four if self.prefetches(program, c, torch.bfloat16))
        return fitting_sub_tiles(program, self._with_tail(program, cfgs))

    @staticmethod
    def _with_tail(program: Program, cfgs) -> tuple:
        """With ``CODETTA_TAIL_LAUNCH=1``, each candidate also with its tail split."""
        cfgs = tuple(cfgs)
        if not (SETTINGS.tail_launch and tail_allowed(program)):
            return cfgs
        return cfgs + tuple(dataclasses.replace(c, tail_split=configs.PINGPONG_TAIL_SPLIT) for c in cfgs)

    @staticmethod
    def ring_slots(program: Program, cfg: Config, dtype: torch.dtype) -> int:
        """Sub-tiles per consumer in the epilogue ring: the whole tile's, or 2 for a
        float32 ring whose program has one tile output and no tile input but its seed
        (``ACCUMULATE_F32``: the seed streams through them, ``pingpong._streamed_seed``;
        the shared memory saved makes room for 5 A/B stages beside 128x128 tiles)."""
        outs = sum(op.is_tile for op in program.outputs)
        if (PingPongEngine.ring_dtype(program, dtype) != torch.float32 or outs != 1 or _in_tiles(program)
                or program.pair_slot >= 0):  # fmt: skip
            return cfg.epi_split
        return min(2, cfg.epi_split)

    @staticmethod
    def shared_bytes(program: Program, cfg: Config, dtype: torch.dtype, prefetch: int = 0) -> int:
        """Estimated shared memory of a launch (the sm_90a check in CI holds it to the
        compiled kernel's size): the A/B stages, the two consumers' epilogue rings
        (``ring_slots`` sub-tiles each) and ``prefetch`` more sub-tiles per consumer (the
        tile inputs' prefetch buffers), plus barriers and alignment."""
        ring = PingPongEngine.ring_dtype(program, dtype).itemsize
        b_rows = cfg.block_n * (2 if program.pair_slot >= 0 else 1)
        slots = PingPongEngine.ring_slots(program, cfg, dtype) + prefetch
        return (
            cfg.num_stages * (cfg.block_m + b_rows) * cfg.block_k * dtype.itemsize
            + 2 * slots * cfg.block_m * cfg.sub_n * ring
            + 1024
        )

    @staticmethod
    def ring_fits(program: Program, cfg: Config, dtype: torch.dtype) -> bool:
        """Whether the A/B stages and the epilogue rings fit in shared memory. A float32
        ring of whole tiles (two tile outputs: ``RESIDUAL_RMS_F32``) leaves room for 3
        stages at 128x128, where a streamed seed's two slots (``ACCUMULATE_F32``) leave
        room for 5."""
        return PingPongEngine.shared_bytes(program, cfg, dtype) <= configs.SMEM_LIMIT

    @staticmethod
    def prefetches(program: Program, cfg: Config, dtype: torch.dtype) -> bool:
        """Whether the tile inputs are prefetched (``pingpong.py``: a buffer of one
        sub-tile per input and consumer, where the shared memory has room for it; an
        estimate, which the sm_90a check in CI holds to the compiled kernel's size)."""
        n_in = len(_in_tiles(program))
        if not n_in:
            return False
        # (with tile inputs the ring holds whole tiles: ring_slots is the split)
        return PingPongEngine.shared_bytes(program, cfg, dtype, prefetch=n_in) <= configs.SMEM_LIMIT

    def unsupported(self, call: GemmCall) -> str | None:
        """Why this mainloop cannot run the call (None: it can)."""
        program = call.program
        if not program.pingpong:
            return f"program {program.name!r} opts out of the ping-pong mainloop"
        if call.device.type != "cuda" or device.interpreting():
            return "the ping-pong mainloop runs on CUDA devices only (no interpreter path)"
        if device.capability(call.device.index or 0) != (9, 0):
            return f"the ping-pong mainloop needs an sm_90 GPU, not {device.name(call.device.index or 0)}"
        if call.dtype not in _GL_DTYPES:
            return f"the ping-pong mainloop takes bfloat16 or float16, not {call.dtype}"
        if program.pair_slot >= 0 and call.b_t:
            return "a paired weight on the ping-pong mainloop must be [N, K] row-major (B not transposed)"
        values = list(call.inputs) + [None] * len(program.outputs)
        ring = self.ring_dtype(program, call.dtype)
        bad = [
            op.name
            for op, v in zip(program.slots, values)
            if op.is_tile and not _fits_ring(op, v, ring, call.dtype)
        ]
        if bad:
            return (f"tile operands {bad} are not in the epilogue ring's dtype ({ring}: the GEMM's, "
                    "or float32 when every tile operand, or every tile input, declares it)")  # fmt: skip
        return None

    def constexprs(self, program: Program, in_kinds, cfg: Config, dtype, a_t, b_t) -> dict:
        ring = self.ring_dtype(program, dtype)
        return {
            "NUM_OPS": len(program.slots), "SEED": program.seed_slot, "PAIR": program.pair_slot,
            "KPARTS": program.k_parts, "NPARTS": program.n_parts, "MPARTS": program.m_parts,
            "OUT_PARTS": program.out_parts, "BODY": program.sm90_body or program.body,
            "IN_KINDS": in_kinds, "OUT_KINDS": program.out_kinds, "RING_DTYPE": _GL_RING_DTYPES[ring],
            "RING_LAYOUT": _gl_layout((cfg.block_m, cfg.sub_n), ring), "EPI_SPLIT": cfg.epi_split,
            "A_T": a_t, "B_T": b_t, "STAGES": cfg.num_stages,
            "CONSUMER_REGS": program.pingpong_regs or pingpong.CONSUMER_REGS,
            "IN_TILES": _in_tiles(program), "PREFETCH": self.prefetches(program, cfg, dtype),
            "RING_SLOTS": self.ring_slots(program, cfg, dtype), "STORES_FIRST": program.stores_first,
        }  # fmt: skip

    def signature(self, program: Program, cfg: Config, dtype, a_t: bool, b_t: bool) -> dict:
        from triton.runtime.jit import mangle_type

        def desc(block, t_dtype=dtype):
            t = torch.empty(256, 256, dtype=t_dtype)
            return mangle_type(GluonTensorDescriptor.from_tensor(t, block, _gl_layout(tuple(block), t.dtype)))

        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        sig = {
            "a_desc": desc([bk, bm] if a_t else [bm, bk]),
            "b_desc": desc([bk, bn] if b_t else [bn, bk]),
            "M": "i32", "N": "i32", "K": "i32", "GROUP_M": "i32", "TILES": "i32",
        }  # fmt: skip
        for i, op in enumerate(program.slots):
            if op.kind in (Kind.PAIRED_WEIGHT, Kind.K_PART_B, Kind.N_PART):
                sig[f"o{i}"] = desc([bk, bn] if b_t else [bn, bk])
            elif op.kind in (Kind.K_PART_A, Kind.M_PART):
                sig[f"o{i}"] = desc([bk, bm] if a_t else [bm, bk])
            elif op.is_tile or op.kind is Kind.TILE_PART:
                sig[f"o{i}"] = desc(tile_block(op, cfg), slot_dtype(op, dtype))
            else:
                sig[f"o{i}"] = _slot_type(op, dtype, None)
        for i in range(len(program.slots), MAX_OPERANDS):
            sig[f"o{i}"] = "constexpr"
        return sig

    def _consts_of(self, call: GemmCall, cfg: Config) -> dict:
        key = (call.program, call.in_kinds, cfg, call.dtype, call.a_t, call.b_t)
        consts = self._consts.get(key)
        if consts is None:
            consts = self._consts[key] = self.constexprs(*key)
        return consts

    @staticmethod
    def _grid(call: GemmCall, cfg: Config) -> int:
        sms = device.grid_sms(call.device.index or 0)
        return min(sms, cdiv(call.M, cfg.block_m) * cdiv(call.N, cfg.block_n))

    def tail_plan(self, call: GemmCall, cfg: Config) -> TailLaunch | None:
        """How the call's last partial wave is split (None: it runs as it is); a config
        whose split tail kernel spilled registers runs unsplit."""
        spilled = _spill_key(call, cfg) in self._tail_spills
        if spilled or not tail_allowed(call.program):
            return None
        return pingpong_tail(cfg, call.M, call.N, call.k_total, self._grid(call, cfg), SETTINGS.tail_split)

    def launch(self, call: GemmCall, cfg: Config, outs: list, warmup: bool = False):
        """Run the call with this configuration (``warmup``: only compile it); returns
        the compiled kernel. With a split tail, the ping-pong kernel runs the main tiles
        and the portable kernel the tail (``pingpong_tail``)."""
        why = self.unsupported(call)
        if why is not None:
            raise ValueError(f"config {cfg.short()}: {why}")
        tail = self.tail_plan(call, cfg)
        spill_key = _spill_key(call, cfg) if tail is not None and not warmup else None
        if spill_key is not None and spill_key not in self._spills_read:
            # decided once per config before its first real launch (every later call of
            # every shape is final, as the portable tail split's): a tail kernel that
            # spills runs the config unsplit
            self._spills_read.add(spill_key)
            if not device.interpreting() and _spills(TRITON.launch_tail(call, tail, outs, warmup=True)):
                self._tail_spills.add(spill_key)
                tail = None
        a_desc, b_desc = matrix_descs(_gl_desc, call, cfg)
        specs = slot_specs(call, slot_descs(call, cfg, whole_seed=False), outs)
        slots = [v if d is None else _gl_desc(v, *d) for d, v in zip(specs, (*call.inputs, *outs))]
        slots += [None] * (MAX_OPERANDS - len(slots))
        tiles = cdiv(call.M, cfg.block_m) * cdiv(call.N, cfg.block_n) if tail is None else tail.main
        with device.on_device(call.device):
            kernel = pingpong.pingpong_kernel.run(
                a_desc, b_desc, call.M, call.N, call.K, cfg.group_m, tiles, *slots,
                **self._consts_of(call, cfg), grid=(self._grid(call, cfg),), warmup=warmup,
                num_warps=cfg.num_warps, maxnreg=pingpong.MAXNREG,
            )  # fmt: skip
        if tail is not None:
            TRITON.launch_tail(call, tail, outs, warmup=warmup)
        return kernel

    def bind(self, call: GemmCall, cfg: Config, outs: list, compiled):
        """As ``TritonEngine.bind``."""
        if compiled is None:
            return None
        tail = self.tail_plan(call, cfg)
        tail_run = None if tail is None else TRITON.bind_tail(call, tail, outs)
        if tail is not None and tail_run is None:
            return None
        kernel = DirectKernel(pingpong.pingpong_kernel, compiled, 19, self._consts_of(call, cfg),
                              self._grid(call, cfg))  # fmt: skip
        a_spec, b_spec = matrix_specs(call, cfg)
        per_slot = slot_specs(call, slot_descs(call, cfg, whole_seed=False), outs)
        specs = tuple(
            None if s is None else (*s, _gl_layout(tuple(s[2]), slot_dtype(op, call.dtype)))
            for op, s in zip(call.program.slots, per_slot)
        )
        a_spec = (*a_spec, _gl_layout(tuple(a_spec[2]), call.dtype))
        b_spec = (*b_spec, _gl_layout(tuple(b_spec[2]), call.dtype))
        pad = (None,) * (MAX_OPERANDS - len(specs))
        M, N, K, group_m = call.M, call.N, call.K, cfg.group_m
        tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n) if tail is None else tail.main

        def run(a, w, inputs, outs, stream):
            slots = [v if d is None else tma_desc(v, *d) for d, v in zip(specs, (*inputs, *outs))]
            kernel(stream, tma_desc(a, *a_spec), tma_desc(w, *b_spec), M, N, K, group_m, tiles, *slots, *pad)
            if tail_run is not None:
                tail_run(a, w, inputs, outs, stream)

        return run


@dataclasses.dataclass(frozen=True)
class TailLaunch:
    """A ping-pong launch's split tail: the ping-pong kernel runs the first ``main`` tiles
    (whole waves of its ``grid``), then the portable kernel (config ``cfg``: the same tile,
    grouping and epilogue split) the last ``tail`` tiles, each split along K into
    ``splits`` parts on ``tail * splits`` programs (more than the grid where that is
    faster: they queue), its tile order the ping-pong grid's."""

    main: int
    tail: int
    splits: int
    grid: int
    cfg: Config


def own_launch_tail(cfg: Config, tiles: int, grid: int, k_blocks: int, tail_cfg: Config) -> TailLaunch | None:
    """The last partial wave of ``tiles`` on ``grid`` programs split along K in a launch of
    its own, run with ``tail_cfg`` (None: a single wave, no tail, or no split that pays)."""
    tail = tiles % grid
    if tiles <= grid or tail == 0:  # (one wave or less: nothing runs beside a split)
        return None
    min_k = 1 if device.interpreting() else configs.MIN_K_BLOCKS_PER_PART
    splits = configs.launch_tail_splits(cfg, tail, grid, k_blocks, min_k)
    return TailLaunch(tiles - tail, tail, splits, grid, tail_cfg) if splits > 1 else None


def pingpong_tail(cfg: Config, M: int, N: int, K: int, grid: int, enabled: bool = True) -> TailLaunch | None:
    """The split of a ping-pong launch's last partial wave (None: no tail split). A CTA
    runs the tiles t = its index (mod grid), so the last ``tiles % grid`` tiles make the
    round that leaves the other SMs idle."""
    if cfg.tail_split < 2 or not cfg.pingpong or not enabled:
        return None
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    return own_launch_tail(cfg, tiles, grid, cdiv(K, cfg.block_k), configs.pingpong_tail_config(cfg))


def _spills(kernel) -> int:
    """Registers a compiled kernel spills: known once its binary is loaded (Triton's
    ``run`` property loads it)."""
    if hasattr(kernel, "result"):  # (a compile still running: Triton's async mode)
        kernel = kernel.result()
    kernel.run  # noqa: B018
    return kernel.n_spills or 0


TRITON = TritonEngine()
PINGPONG = PingPongEngine()


def engine_of(cfg: Config):
    return PINGPONG if cfg.pingpong else TRITON
