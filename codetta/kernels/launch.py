"""``gemm``: validate, pick a configuration, allocate, launch, finish the reductions.

``gemm(a, weight, epilogue=program, **operands)`` computes ``acc = a @ weight.T``
in fp32 and runs the program on it. ``a`` [M, K] and ``weight`` [N, K] may each
be a transposed view of a contiguous tensor (stride 1 in the first dimension):
the backward products ``dY @ W`` (``gemm(dy, w.t())``) and ``dY^T @ X``
(``gemm(dy.t(), x.t())``) run on the same mainloops that way.

Where it runs: on CUDA the chosen mainloop's kernel; on CPU with
``TRITON_INTERPRET=1`` set before import, the portable mainloop through the
Triton interpreter; on CPU without it (or for bfloat16, whose dot products the
interpreter gets wrong), the program's PyTorch reference.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch

from . import device, direct, precompile, reductions
from .configs import Config, interpreter_config, part_edges, tiles_fit_parts
from .engines import PINGPONG, TRITON, engine_of
from .memo import Memo
from .operands import GemmCall, check_outputs, make_call, output_shape
from .program import REDUCTIONS, STORE, Kind, Layout, Program
from .settings import SETTINGS
from .tuning import CHOOSER, candidates, pingpong_allowed


def alloc(shape, dtype, dev):
    """A new tensor for a kernel to fill: NaN under the ``poison_outputs`` test hook (an
    unwritten element cannot pass), else uninitialized."""
    if SETTINGS.poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)


def _output_meta(call: GemmCall) -> list[_Meta]:
    """Shape, dtype and device of each of the program's outputs (independent of the config)."""
    return [
        _Meta(*output_shape(op, call.M, call.N, call.dtype, call.out_dims(op)), call.device)
        for op in call.program.outputs
    ]


@dataclass(frozen=True)
class _Meta:
    shape: tuple
    dtype: torch.dtype
    device: torch.device


def alloc_outputs(call: GemmCall, given: tuple | None = None) -> list[torch.Tensor]:
    """The program's outputs as the caller gets them (independent of the config); the
    caller's own where ``given`` (``gemm(out=...)``) has one."""
    metas = _output_meta(call)
    if given is None:
        return [alloc(m.shape, m.dtype, m.device) for m in metas]
    return [g if g is not None else alloc(m.shape, m.dtype, m.device) for m, g in zip(metas, given)]


def alloc_workspaces(call: GemmCall, cfg: Config) -> list:
    """Per output, the tensor the kernel writes: the output itself for tiles, the
    partials of this geometry for reductions (None)."""
    lay = Layout(cfg.block_m, cfg.block_n, cfg.sub_n)
    return [
        alloc(reductions.workspace_shape(op.kind, call.M, call.N, lay), torch.float32, call.device)
        if op.kind in REDUCTIONS else None
        for op in call.program.outputs
    ]  # fmt: skip


@functools.lru_cache(maxsize=256)
def parts_fit(program: Program, dev: torch.device, widths: tuple = (), heights: tuple = ()) -> bool:
    """Whether some configuration of ``program`` on ``dev`` puts every boundary between
    N parts (``widths``) and M parts (``heights``) on a tile edge (operators fall back to
    separate GEMMs where none does, e.g. heads too narrow for the GPU's tiles). Asked on
    every operator call: answered once per program, device and sizes."""
    if dev.type == "cpu" and not device.interpreting():
        return True  # the PyTorch reference takes any sizes
    if device.interpreting():
        cfgs = [interpreter_config(program.sub_tile_width)]
    else:
        cfgs = TRITON.candidates(program) + PINGPONG.candidates(program)
    return any(tiles_fit_parts(c, widths, heights) for c in cfgs)


def check_parts(call: GemmCall, cfg: Config) -> None:
    """With M or N parts, every boundary between parts must fall on a tile edge."""
    if tiles_fit_parts(cfg, call.widths, call.heights):
        return
    what, sizes, block = (
        ("weights' rows", call.widths, cfg.block_n)
        if any(e % cfg.block_n for e in part_edges(call.widths))
        else ("A rows", call.heights, cfg.block_m)
    )
    raise ValueError(
        f"program {call.program.name!r}: the parts' {what} {sizes} put a boundary inside a tile of "
        f"config {cfg.short()} (its tile size {block} must divide every part but the last)"
    )


def _run(call: GemmCall, cfg: Config, outs: list, ws: list, warmup: bool = False):
    """Launch; returns the compiled GEMM kernel and, per output, the finishing kernel
    (None for a tile, or where nothing was compiled)."""
    check_parts(call, cfg)
    kernel_outs = [w if w is not None else o for o, w in zip(outs, ws)]
    kernel = engine_of(cfg).launch(call, cfg, kernel_outs, warmup)
    if warmup:
        if precompile.active():  # (the finishing kernels compile beside it)
            for op, out, w in zip(call.program.outputs, outs, ws):
                if w is not None:
                    reductions.finish(op.kind, w, out)
        return kernel, []
    finishers = [
        reductions.finish(op.kind, w, out) if w is not None else None
        for op, out, w in zip(call.program.outputs, outs, ws)
    ]
    return kernel, finishers


class _Bound:
    """A call signature seen before (program, shapes, strides, dtypes, devices, pointer
    alignment, operand names and types, config, settings): validated, configured and
    compiled once. Later calls of the signature skip validation, the config lookup and
    Triton's per-launch binding (direct.py); in the interpreter they run ``_run``."""

    def __init__(self, call: GemmCall, cfg: Config, outs: list, ws: list, compiled):
        prog = call.program
        self.program, self.cfg, self.a_t, self.b_t = prog, cfg, call.a_t, call.b_t
        self.names = tuple(op.name for op in prog.caller_inputs)
        self.scalars = tuple(op.kind is Kind.SCALAR for op in prog.caller_inputs)
        self.dev = call.device
        self.out_specs = tuple((tuple(o.shape), o.dtype) for o in outs)
        self.ws_specs = tuple(None if w is None else tuple(w.shape) for w in ws)
        self.single = len(outs) == 1
        self.launch = self.finishers = None
        kernel, finishers = compiled
        if kernel is not None and call.device.type == "cuda":
            kernel_outs = [w if w is not None else o for o, w in zip(outs, ws)]
            self.launch = engine_of(cfg).bind(call, cfg, kernel_outs, kernel)
            self.finishers = tuple(
                None if w is None else reductions.bind_finish(op.kind, w, f, op.split)
                for op, w, f in zip(prog.outputs, ws, finishers)
            )  # fmt: skip
            if self.launch is None or any(w is not None and f is None for w, f in zip(ws, self.finishers)):
                self.launch = None  # not final (a spilling tail split): the next call binds again
                self.usable = False
                return
        self.usable = True

    def __call__(self, a: torch.Tensor, w: torch.Tensor, operands: dict, given=None):
        inputs = tuple(
            float(operands[n]) if scalar else operands[n] for n, scalar in zip(self.names, self.scalars)
        )
        dev = self.dev
        if given is None:
            outs = [alloc(shape, dtype, dev) for shape, dtype in self.out_specs]
        else:
            outs = [g if g is not None else alloc(s[0], s[1], dev) for g, s in zip(given, self.out_specs)]
        ws = [None if shape is None else alloc(shape, torch.float32, dev) for shape in self.ws_specs]
        if self.launch is None or not SETTINGS.direct_launch or not direct.usable():
            _run(GemmCall(self.program, a, w, self.a_t, self.b_t, inputs), self.cfg, outs, ws)
        else:
            index = dev.index
            if index != torch._C._cuda_getDevice():  # torch.cuda.current_device() without its init check
                with torch.cuda.device(index):
                    self._launch(a, w, inputs, outs, ws, direct.raw_stream(index))
            else:
                self._launch(a, w, inputs, outs, ws, direct.raw_stream(index))
        if self.single:
            return outs[0]
        return self.program.result(*outs)

    def _launch(self, a, w, inputs, outs, ws, stream):
        self.launch(a, w, inputs, [p if p is not None else o for o, p in zip(outs, ws)], stream)
        for fin, out, parts in zip(self.finishers, outs, ws):
            if fin is not None:
                fin(parts, out, stream)


def _as_tuple(out) -> tuple:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


_BOUND = Memo()  # distinct call signatures remembered (forgotten all at once past its limit)


def _tensor_key(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def _signature(program, a, weight, operands: dict, config, out=None) -> tuple | None:
    """The key of a call's ``_Bound``; None for what only the full path handles (or rejects)."""
    try:
        key = [program, config, SETTINGS.generation, CHOOSER.generation, _tensor_key(a), _tensor_key(weight)]
        for name, v in operands.items():
            key.append(name)
            key.append(_tensor_key(v) if isinstance(v, torch.Tensor) else type(v))
        if out is not None:
            outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            key.append(tuple(None if t is None else _tensor_key(t) for t in outs))
        key = tuple(key)
        hash(key)
        return key
    except (AttributeError, TypeError, RuntimeError):  # (RuntimeError: torch.func's, no storage)
        return None


def _prepare_for_tuning(call: GemmCall):
    """``cfg -> fn`` for the tuner: outputs shared by all candidates (programs only write
    them), workspaces per tile geometry (their shapes depend on it). Nothing is
    allocated until the tuner asks (a memoized choice never does). After its first real
    run a candidate launches as a repeated ``gemm`` call does (``_Bound``: ~20 us of host
    time on the H200 machine, not Triton's ~110): a GEMM shorter than the host's time per
    launch is otherwise timed at the host's pace, and every candidate looks alike
    (NOTES.md, runs 182-186)."""
    outs: list = []
    by_geometry: dict = {}

    def prepare(cfg: Config):
        if not outs:
            outs.extend(alloc_outputs(call))
        lay = (cfg.block_m, cfg.block_n, cfg.sub_n)
        if lay not in by_geometry:
            by_geometry[lay] = alloc_workspaces(call, cfg)
        ws = by_geometry[lay]
        bound: list = []  # the candidate's bound launch and its operands, once it has run

        def run(warmup: bool = False):
            if bound and not warmup:
                launch, operands = bound
                return launch(call.a, call.w, operands, given=tuple(outs))
            compiled = _run(call, cfg, outs, ws, warmup)
            if not warmup and call.device.type == "cuda" and not precompile.active():
                b = _Bound(call, cfg, outs, ws, compiled)
                if b.usable and b.launch is not None:
                    bound[:] = [b, dict(zip(b.names, call.inputs))]
            return compiled

        return run

    prepare.outputs = outs  # (what every candidate writes: for tests)
    return prepare


def _reference(call: GemmCall, outs: list) -> None:
    prog = call.program
    if prog.reference is None:
        raise NotImplementedError(
            f"program {prog.name!r} has no PyTorch reference, so it cannot run with K = 0 (empty "
            "operands), nor on CPU tensors without the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing codetta, or give it reference="
        )
    a, w = call.a, call.w
    if prog.n_parts:  # the weights side by side along N
        w = torch.cat([w, *(call.inputs[i] for i in prog.n_parts)])
    if prog.m_parts:  # the A operands stacked along M
        a = torch.cat([a, *(call.inputs[i] for i in prog.m_parts)])
    acc = a.double() @ w.double().t()
    parts = (Kind.N_PART, Kind.M_PART)
    kwargs = {op.name: v for op, v in zip(prog.caller_inputs, call.inputs) if op.kind not in parts}
    seed = next((op.name for op in prog.inputs if op.kind is Kind.SEED), None)
    if seed is not None:
        acc = acc + kwargs[seed].double()
    for op in prog.inputs:
        if op.kind is Kind.DTYPE:
            kwargs[op.name] = call.dtype
    for ia, iw in prog.k_parts:  # K parts: more products summed in
        acc = acc + call.inputs[ia].double() @ call.inputs[iw].double().t()
    acc = acc.float()
    pair = next((op.name for op in prog.inputs if op.kind is Kind.PAIRED_WEIGHT), None)
    if pair is not None:  # the body's acc is the pair of products
        acc = (acc, (call.a.double() @ kwargs.pop(pair).double().t()).float())
    got = prog.reference(acc, **kwargs)
    if prog.n_parts or prog.m_parts:  # each tile output's columns (rows), split by part
        sizes = call.widths if prog.n_parts else call.heights
        bounds = [0, *part_edges(sizes), sum(sizes)]

        def cut(t, i):
            return t[:, bounds[i] : bounds[i + 1]] if prog.n_parts else t[bounds[i] : bounds[i + 1]]

        for op in prog.outputs:
            if op.kind is Kind.TILE_PART:
                got[op.name] = cut(got[op.index], prog.part_number[op.name])
        for op in prog.outputs:
            if op.kind is Kind.TILE:
                got[op.name] = cut(got[op.name], 0)
    for op, out in zip(prog.outputs, outs):
        if op.name not in got:
            raise KeyError(
                f"program {prog.name!r}: its reference returned no {op.name!r} (it returned {sorted(got)})"
            )
        value = got[op.name]
        if op.kind is Kind.ROW_LSE and op.split and value.dim() == 1:
            # [M] in any dtype (a float64 sum keeps what float32 rounds off) -> (hi, lo)
            hi = value.float()
            lo = torch.where(hi.isfinite(), value.double() - hi.double(), 0.0).float()
            value = torch.stack([hi, lo])
        out.copy_(value)


def _uses_reference(call: GemmCall) -> bool:
    if call.device.type != "cpu":
        return False
    if not device.interpreting() or SETTINGS.force_reference:
        return True
    if call.dtype == torch.bfloat16:
        _warn_bf16()
        return True
    return False


@functools.cache
def _warn_bf16() -> None:
    warnings.warn(
        "codetta: the Triton interpreter gets bfloat16 dot products wrong; bfloat16 CPU calls "
        "run the PyTorch reference of each program instead of the kernel",
        stacklevel=4,
    )


@dataclass(frozen=True)
class RecordedCall:
    """A GEMM call seen under ``recording()``: enough to make it again with fresh data."""

    program: Program
    dtype: torch.dtype
    a_t: bool
    b_t: bool
    M: int  # noqa: N815
    N: int  # noqa: N815
    K: int  # noqa: N815
    # per caller input, in order: (name, shape, dtype) of a tensor, or (name, None, None) of a float
    operands: tuple

    @property
    def k_total(self) -> int:
        """K summed over the products (the first one's and every K part's)."""
        parts = {op.name for op in self.program.inputs if op.kind is Kind.K_PART_A}
        return self.K + sum(shape[1] for name, shape, _ in self.operands if name in parts)


_RECORDS: list | None = None
_COMPUTE = False  # recording(compute=True): record and run


@contextlib.contextmanager
def recording(compute: bool = False):
    """Inside, ``gemm`` validates each call, appends a ``RecordedCall`` to the list this
    yields and returns uninitialized outputs without launching or tuning anything.
    What a model's step asks of the GEMMs (``codetta.tune``), at no compute cost:
    PyTorch code between the calls still runs, on whatever the outputs hold.
    ``compute=True`` records and runs every call as usual (a kernel plan of a real run)."""
    global _RECORDS, _COMPUTE
    outer = _RECORDS, _COMPUTE
    _RECORDS, _COMPUTE = [], compute
    try:
        yield _RECORDS
    finally:
        _RECORDS, _COMPUTE = outer


def dry() -> bool:
    """Whether ``gemm`` calls are being recorded without running (``recording()``): their
    outputs hold nothing, and code that branches on them (the loss's window check) keeps
    to the path a real run takes."""
    return _RECORDS is not None and not _COMPUTE


def _record(call: GemmCall) -> None:
    ops = tuple(
        (op.name, None, None) if op.kind is Kind.SCALAR else (op.name, tuple(v.shape), v.dtype)
        for op, v in zip(call.program.caller_inputs, call.inputs)
    )
    _RECORDS.append(RecordedCall(call.program, call.dtype, call.a_t, call.b_t, call.M, call.N, call.K, ops))


def gemm(a: torch.Tensor, weight: torch.Tensor, *, epilogue: Program | None = None, config=None, out=None,
         **operands):  # fmt: skip
    """``epilogue(a @ weight.T)``: one GEMM with its epilogue program fused.

    Returns the program's single output, or a named tuple of its outputs.
    ``gemm`` itself records no autograd graph: for training use the
    differentiable operators in ``codetta.ops`` / ``codetta.nn``.
    ``config`` (a :class:`codetta.Config`) pins the kernel configuration (and
    so the mainloop) instead of the tuned one. ``out``: tensors to write the
    outputs into (a tensor, or one entry per output, None to allocate; a tile
    output may have any 16-byte-aligned row stride, and may be the tensor that
    seeds the accumulator: each output tile is read as a seed before it is written).
    """
    program = epilogue if epilogue is not None else STORE
    sig = _signature(program, a, weight, operands, config, out) if _RECORDS is None else None
    # (a recorded call takes the full path: the remembered signature would skip the record)
    bound = _BOUND.get(sig) if sig is not None else None
    if bound is not None:
        return bound(a, weight, operands, None if out is None else _as_tuple(out))
    provided = () if out is None else tuple(t is not None for t in _as_tuple(out))
    call = make_call(program, a, weight, operands, provided)
    given = check_outputs(program, out, call)
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a codetta Config, got {type(config).__name__}")
    recorded_only = dry()
    if _RECORDS is not None:
        _record(call)
    if recorded_only:
        outs = [torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in _output_meta(call)]
    else:
        outs = alloc_outputs(call, given)
    if call.M > 0 and not recorded_only:
        if _uses_reference(call) or call.K == 0:  # (K = 0, an empty batch's dW: acc = 0, no kernel;
            # with K parts, the reference sums theirs)
            _reference(call, outs)
        else:
            cfg = config or CHOOSER.choose(call, _prepare_for_tuning(call))
            ws = alloc_workspaces(call, cfg)
            compiled = _run(call, cfg, outs, ws, warmup=precompile.active())
            if sig is not None and not precompile.active():
                bound = _Bound(call, cfg, outs, ws, compiled)
                if bound.usable:
                    _BOUND[sig] = bound
    elif outs:
        for op, out in zip(call.program.outputs, outs):
            if op.kind is Kind.COL_SUM:
                out.zero_()  # a sum over no rows
    if len(outs) == 1:
        return outs[0]
    return call.program.result(*outs)


def tune(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    epilogue: Program | None = None,
    force: bool = False,
    seconds: float = 1.0,
    **operands,
) -> tuple[Config, str]:
    """Tune the configuration of ``gemm(a, weight, epilogue=..., **operands)`` on this GPU
    (timing every candidate; the winner goes to the user's tuning cache) unless the cache
    or this GPU's shipped table knows it already (``force``: tune anyway; a pick another
    GPU's table lends, as the H200's to an H100, is tuned anew). Returns the
    configuration and where it came from: "tuned", "user cache" or "shipped".
    ``seconds``: how long the candidates are timed (paired, alternating)."""
    call = make_call(epilogue if epilogue is not None else STORE, a, weight, operands)
    if call.device.type != "cuda" or device.interpreting():
        raise ValueError("tuning needs a CUDA GPU (the interpreter has one configuration)")
    pp = pingpong_allowed(call)
    cands = candidates(call, pingpong=pp)
    if not force:
        cfg, source = CHOOSER.known(call, pp, cands, lent=False)
        if cfg is not None:
            return cfg, source
    return CHOOSER.tune(call, _prepare_for_tuning(call), pp, cands, seconds), "tuned"


__all__ = ["gemm", "recording", "RecordedCall", "tune"]
