"""The launcher: validate, allocate, pick a config, build descriptors, launch.

``gemm(a, weight, epilogue=..., **operands)`` computes ``acc = a @ weight.T``
in fp32 and runs the epilogue program on it. ``a`` [M, K] and ``weight``
[N, K] may each be a transposed view of a contiguous tensor (stride 1 in the
first dimension): the backward products ``dY @ W`` (``gemm(dy, w.t())``) and
``dY^T @ X`` (``gemm(dy.t(), x.t())``) run on the same mainloop that way.

On CUDA the Triton kernel runs. On CPU with ``TRITON_INTERPRET=1`` set before
import, the same kernel runs through the Triton interpreter; on CPU without
it, the program's PyTorch reference runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import warnings

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from . import pingpong, timing, tuning
from .mainloop import MAX_OPERANDS, gemm_kernel
from .program import Epilogue, Kind, Layout, Operand

# Tests set this to fill every output with NaN before a launch, so an element
# the kernel fails to write cannot pass.
POISON_OUTPUTS = False

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def interpreting() -> bool:
    """True when the Triton kernels run through the interpreter (set before import)."""
    return isinstance(gemm_kernel, InterpretedFunction)


def _interpreter_cannot(dtype: torch.dtype) -> bool:
    """The Triton interpreter computes bf16 ``tl.dot`` wrongly (triton 3.6): such
    calls take the PyTorch reference path instead, with a warning, once."""
    if dtype != torch.bfloat16:
        return False
    global _WARNED_BF16
    if not _WARNED_BF16:
        _WARNED_BF16 = True
        warnings.warn(
            "codetta: the Triton interpreter gets bfloat16 dot products wrong; bfloat16 CPU calls "
            "run the PyTorch reference of each program instead of the kernel",
            stacklevel=3,
        )
    return True


_WARNED_BF16 = False


def _check_matrix(name: str, t, dim_names: str) -> str:
    """Validate a 2-D GEMM operand; return 'n' (rows contiguous) or 't' (a transposed view)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [{dim_names}], got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    es = t.element_size()
    if t.stride(1) == 1 or t.shape[1] == 1:
        order, lead = "n", t.stride(0)
    elif t.stride(0) == 1 or t.shape[0] == 1:
        order, lead = "t", t.stride(1)
    else:
        raise ValueError(
            f"{name} must have unit stride in one dimension (contiguous or a transposed view), "
            f"got strides {t.stride()}; call .contiguous() first"
        )
    if (lead * es) % 16 or t.data_ptr() % 16:
        raise ValueError(
            f"{name}: rows must start on 16-byte boundaries for TMA; shape {tuple(t.shape)}, "
            f"strides {t.stride()}, {t.dtype} (for 2-byte dtypes the contiguous dimension "
            "must be a multiple of 8)"
        )
    return order


def _check_operand(ep: Epilogue, op: Operand, value, ref: torch.Tensor, M: int, N: int):
    where = f"epilogue {ep.name!r} operand {op.name!r}"
    if op.kind is Kind.SCALAR:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a Python int or float, got {type(value).__name__}")
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(value).__name__}")
    if value.device != ref.device:
        raise ValueError(f"{where} is on {value.device}, the GEMM inputs on {ref.device}")
    want = {Kind.TILE: (M, N), Kind.ROW: (N,), Kind.COL: (M,)}[op.kind]
    if tuple(value.shape) != want:
        raise ValueError(f"{where} must have shape {want} ({op.kind.value}), got {tuple(value.shape)}")
    if op.kind is Kind.TILE:
        if value.dtype not in _DTYPES:
            raise TypeError(f"{where} must be bfloat16, float16 or float32, got {value.dtype}")
        if value.stride(1) != 1 or (value.stride(0) * value.element_size()) % 16 or value.data_ptr() % 16:
            raise ValueError(
                f"{where} must be row-contiguous with 16-byte aligned rows, got strides {value.stride()}"
            )
    elif value.dim() == 1 and value.numel() > 1 and value.stride(0) != 1:
        raise ValueError(f"{where} must be contiguous, got stride {value.stride()}")
    return value


def _alloc(shape, dtype, device):
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _output_shape(kind: Kind, M: int, N: int, lay: Layout) -> tuple:
    if kind is Kind.TILE:
        return (M, N)
    if kind is Kind.COL:
        return (M,)
    if kind is Kind.ROW_PARTIAL:
        return (M, -(-N // lay.sub_n))
    if kind is Kind.TILE_ROW_PARTIAL:
        return (M, -(-N // lay.block_n))
    return (-(-M // lay.block_m), N)  # COL_PARTIAL


def _alloc_outputs(ep: Epilogue, M: int, N: int, in_dtype, device, lay: Layout) -> list:
    return [
        _alloc(
            _output_shape(op.kind, M, N, lay),
            op.dtype or (in_dtype if op.kind is Kind.TILE else torch.float32),
            device,
        )
        for op in ep.outputs
    ]


def _kernel_arg(op: Operand, t, cfg: tuning.Config, whole_tile: bool):
    if op.kind is Kind.TILE:
        return TensorDescriptor.from_tensor(t, [cfg.block_m, cfg.block_n if whole_tile else cfg.sub_n])
    return t


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(a, w, a_order, w_order, ep, inputs, outputs, M, N, K, cfg: tuning.Config):
    if cfg.pingpong:
        _launch_pingpong(a, w, a_order, w_order, ep, inputs, outputs, M, N, K, cfg)
        return
    spill_key = (id(ep.apply), cfg, a.dtype, a_order, w_order, a.device)
    if cfg.tail_split > 1 and spill_key in _TAIL_SPILLS:
        cfg = dataclasses.replace(cfg, tail_split=1)
    if a_order == "t":
        a_desc = TensorDescriptor(a, [K, M], [a.stride(1), 1], [cfg.block_k, cfg.block_m])
    else:
        a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [cfg.block_m, cfg.block_k])
    if w_order == "t":
        b_desc = TensorDescriptor(w, [K, N], [w.stride(1), 1], [cfg.block_k, cfg.block_n])
    else:
        b_desc = TensorDescriptor(w, [N, K], [w.stride(0), 1], [cfg.block_n, cfg.block_k])
    init = ep.acc_init_index
    ops = tuple(
        _kernel_arg(op, t, cfg, i == init)
        for i, (op, t) in enumerate(zip(ep.inputs + ep.outputs, inputs + outputs))
    )
    num_sms = tuning.INTERPRETER_NUM_SMS if interpreting() else _num_sms(a.device.index or 0) * cfg.occupancy
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    min_k = 1 if interpreting() else tuning.MIN_K_BLOCKS_PER_PART
    splits = tuning.tail_splits(cfg, tiles, num_sms, triton.cdiv(K, cfg.block_k), min_k)
    if splits > 1:
        tail = tiles % num_sms
        # one fp32 partial tile per tail part
        ws = torch.empty(tail * splits * cfg.block_m * cfg.block_n, dtype=torch.float32, device=a.device)
        counts = _tail_counters(a.device)
        grid = min(num_sms, max(tiles, tail * splits))
    else:
        ws, counts = _dummy(a.device, torch.float32), _dummy(a.device, torch.int32)
        grid = min(num_sms, tiles)
    slots = list(ops) + [None] * (MAX_OPERANDS - len(ops))
    args = [a_desc, b_desc, M, N, K, *slots, ws, counts, splits]
    consts = {
        "NUM_OPS": len(ops), "ACC_INIT": init,
        "EPI_APPLY": ep.apply, "EPI_INIT": ep.init, "EPI_FINISH": ep.finish,
        "A_T": a_order == "t", "B_T": w_order == "t",
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m, "EPI_SPLIT": cfg.epi_split, "NUM_SMS": num_sms,
        "FLATTEN": cfg.flatten, "WARP_SPECIALIZE": cfg.warp_specialize,
        "IEEE": a.dtype == torch.float32, "TAIL_SPLIT": cfg.tail_split,
    }  # fmt: skip
    with _on_device(a.device):
        kernel = gemm_kernel[(grid,)](*args, **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.tail_split > 1 and getattr(kernel, "n_spills", 0):
        # the program leaves no registers for the tail path: run this config unsplit
        _TAIL_SPILLS.add(spill_key)
        if os.environ.get("CODETTA_TUNE_VERBOSE") == "1":
            print(f"codetta: {ep.name} {cfg.short()} spills in its tail path: runs unsplit", file=sys.stderr)


def pingpong_unsupported(ep: Epilogue, a: torch.Tensor) -> str | None:
    """Why the sm_90 ping-pong mainloop cannot run this call (None: it can)."""
    if ep.sm90 is None:
        return f"epilogue {ep.name!r} has no sm90 (Gluon) program"
    if a.device.type != "cuda" or interpreting():
        return "the ping-pong mainloop runs on CUDA devices only (no interpreter path)"
    if _capability(a.device.index or 0) != (9, 0):
        return f"the ping-pong mainloop needs an sm_90 GPU, not {torch.cuda.get_device_name(a.device)}"
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"the ping-pong mainloop takes bfloat16 or float16, not {a.dtype}"
    ops = ep.inputs + ep.outputs
    if len(ops) > pingpong.MAX_OPERANDS:
        return f"the ping-pong mainloop takes at most {pingpong.MAX_OPERANDS} operands"
    bad = [op.name for op in ops if op.kind is Kind.TILE and op.dtype not in (None, a.dtype)]
    if bad:
        return f"tile operands {bad} are not in the GEMM's dtype (the epilogue tile is {a.dtype})"
    return None


@functools.cache
def _capability(device_index: int) -> tuple:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def _gl_layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _gl_desc(t: torch.Tensor, shape, strides, block):
    return GluonTensorDescriptor(t, shape, strides, block, _gl_layout(tuple(block), t.dtype))


def _launch_pingpong(a, w, a_order, w_order, ep, inputs, outputs, M, N, K, cfg: tuning.Config):
    why = pingpong_unsupported(ep, a)
    if why is not None:
        raise ValueError(f"config {cfg.short()}: {why}")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if a_order == "t":
        a_desc = _gl_desc(a, [K, M], [a.stride(1), 1], [bk, bm])
    else:
        a_desc = _gl_desc(a, [M, K], [a.stride(0), 1], [bm, bk])
    if w_order == "t":
        b_desc = _gl_desc(w, [K, N], [w.stride(1), 1], [bk, bn])
    else:
        b_desc = _gl_desc(w, [N, K], [w.stride(0), 1], [bn, bk])
    ops = [
        _gl_desc(t, [M, N], [t.stride(0), 1], [bm, bn]) if op.kind is Kind.TILE else t
        for op, t in zip(ep.inputs + ep.outputs, inputs + outputs)
    ]
    slots = ops + [None] * (pingpong.MAX_OPERANDS - len(ops))
    buf_layout = _gl_layout((bm, bn), a.dtype)
    grid = pingpong.grid_size(M, N, cfg, _num_sms(a.device.index or 0))
    with _on_device(a.device):
        pingpong.pingpong_kernel[(grid,)](
            a_desc, b_desc, M, N, K, cfg.group_m, *slots,
            NUM_OPS=len(ops), ACC_INIT=ep.acc_init_index, EPI=ep.sm90,
            BUF_DTYPE=_GL_DTYPES[a.dtype], BUF_LAYOUT=buf_layout, A_T=a_order == "t", B_T=w_order == "t",
            STAGES=cfg.num_stages, CONSUMER_REGS=pingpong.CONSUMER_REGS,
            num_warps=cfg.num_warps, maxnreg=pingpong.MAXNREG,
        )  # fmt: skip


def _tail_counters(device: torch.device) -> torch.Tensor:
    """Per-tile arrival counters of the tail split, zero between launches (the last
    part of each tile resets its counter). One buffer per device and stream, so
    launches on different streams never share one."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(1024, dtype=torch.int32, device=device)
    return buf


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # stands in for the workspace and counters when no tile is split (never read)
    buf = _DUMMIES.get((device, dtype))
    if buf is None:
        buf = _DUMMIES[device, dtype] = torch.zeros(16, dtype=dtype, device=device)
    return buf


_COUNTERS: dict = {}
_DUMMIES: dict = {}
# (program, config, dtype, layout, device) whose tail-split kernel spills registers
_TAIL_SPILLS: set = set()


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


@functools.cache
def _tune_cache(device_index: int) -> tuning.TuneCache:
    from .. import __version__

    identity = {
        "gpu": torch.cuda.get_device_name(device_index),
        "triton": triton.__version__,
        "codetta": __version__,
    }
    return tuning.TuneCache(tuning.default_cache_path(), identity)


def _measure(fns: dict) -> dict:
    torch.cuda.synchronize()
    return timing.paired_ms(fns, min_s=1.0, min_cycles=7, warm_s=0.5)


def candidate_configs(ep: Epilogue) -> list[tuning.Config]:
    """The GPU configurations the tuner tries for a program."""
    if ep.configs is not None:
        cfgs = list(ep.configs)
    else:
        cfgs = tuning.gpu_candidates(sum(op.kind is Kind.TILE for op in ep.inputs + ep.outputs))
    if not ep.tail_split:
        cfgs = list(dict.fromkeys(dataclasses.replace(c, tail_split=1) for c in cfgs))
    if ep.sm90 is not None:
        cfgs += tuning.PINGPONG_CANDIDATES
    return cfgs


_CHOSEN: dict = {}


def _pingpong_off() -> bool:
    return os.environ.get("CODETTA_PINGPONG") == "0"


def _pick_config(ep, a, w, a_order, w_order, inputs, M, N, K) -> tuning.Config:
    if interpreting():
        return tuning.INTERPRETER_CONFIG
    # ep: its name and its functions; CODETTA_PINGPONG=0 leaves the ping-pong mainloop out
    exact = (ep, a.dtype, a_order, w_order, M, N, K, a.device.index, _pingpong_off())
    cfg = _CHOSEN.get(exact)
    if cfg is None:
        cfg = _CHOSEN[exact] = _tuned_config(ep, a, w, a_order, w_order, inputs, M, N, K)
    return cfg


def _tuning_outputs(ep: Epilogue, M: int, N: int, dtype, device):
    """``cfg -> outputs`` for the tuner's candidates: one set per tile geometry (the
    partial-reduction outputs' shapes depend on it), shared by the candidates that
    have it; tile outputs ([M, N] in any geometry) are shared by all. Programs only
    write their outputs, so sharing is safe, and a vocabulary GEMM's [16384, 128256]
    output is allocated once, not once per candidate (17 x 4 GB)."""
    sets: dict = {}
    tiles: dict = {}  # tile outputs are [M, N] whatever the geometry: one buffer each

    def outputs_for(cfg: tuning.Config) -> list:
        lay = Layout(cfg.block_m, cfg.block_n, cfg.sub_n)
        if lay not in sets:
            outs = _alloc_outputs(ep, M, N, dtype, device, lay)
            sets[lay] = [
                tiles.setdefault(i, t) if op.kind is Kind.TILE else t
                for i, (op, t) in enumerate(zip(ep.outputs, outs))
            ]
        return sets[lay]

    return outputs_for


def _tuned_config(ep, a, w, a_order, w_order, inputs, M, N, K) -> tuning.Config:
    # the program's source hash keeps two programs of one name (or an edited
    # program) from sharing a tuned config
    src = getattr(ep.apply, "cache_key", "")[:10] + getattr(ep.sm90, "cache_key", "")[:6]
    key = "|".join(
        [f"{ep.name}@{src}" if src else ep.name, str(a.dtype).removeprefix("torch."), a_order + w_order]
        + [str(tuning.shape_bucket(x)) for x in (M, N, K)]
    )
    candidates = candidate_configs(ep)
    pingpong_possible = pingpong_unsupported(ep, a) is None
    if not pingpong_possible or _pingpong_off():
        candidates = [c for c in candidates if not c.pingpong]
    if pingpong_possible and _pingpong_off():
        key += "|no-pingpong"
    # a sweep over both mainloops also answers CODETTA_PINGPONG=0 (A/B runs): no second tuning
    record_triton_pick = pingpong_possible and not _pingpong_off()
    if os.environ.get("CODETTA_AUTOTUNE", "1") == "0":
        return candidates[0]
    cache = _tune_cache(a.device.index or 0)
    cfg = cache.get(key)
    if cfg is None:
        outputs_for = _tuning_outputs(ep, M, N, a.dtype, a.device)

        def prepare(c):
            outs = outputs_for(c)
            return lambda: _launch(a, w, a_order, w_order, ep, inputs, outs, M, N, K, c)

        times = tuning.tune_times(key, candidates, prepare, _measure)
        cfg = min(times, key=times.get)
        cache.put(key, cfg)
        triton_times = {c: ms for c, ms in times.items() if not c.pingpong}
        if record_triton_pick and triton_times:
            cache.put(key + "|no-pingpong", min(triton_times, key=triton_times.get))
    return cfg


def _reference(ep: Epilogue, a, w, inputs, outputs, cfg: tuning.Config):
    if ep.reference is None:
        raise NotImplementedError(
            f"epilogue {ep.name!r} has no PyTorch reference, so it cannot run on CPU tensors without "
            "the Triton interpreter: set TRITON_INTERPRET=1 before importing codetta, or give it reference="
        )
    acc = a.double() @ w.double().t()
    lay = Layout(cfg.block_m, cfg.block_n, cfg.sub_n)
    kwargs = {op.name: v for op, v in zip(ep.inputs, inputs)}
    if ep.acc_init is not None:
        acc = acc + kwargs[ep.acc_init].double()
    got = ep.reference(acc.float(), lay, **kwargs)
    for op, out in zip(ep.outputs, outputs):
        out.copy_(got[op.name])


@functools.lru_cache(maxsize=1)
def _default_epilogue() -> Epilogue:
    from ..programs.basic import STORE

    return STORE


def gemm(a: torch.Tensor, weight: torch.Tensor, *, epilogue: Epilogue | None = None, config=None, **operands):
    """``epilogue(a @ weight.T)``: one GEMM with its epilogue program fused.

    Returns the program's single output, or a named tuple of its outputs.
    ``gemm`` itself records no autograd graph: for training use the
    differentiable operators in ``codetta.ops`` / ``codetta.nn``.
    ``config`` (a :class:`codetta.kernels.tuning.Config`) pins the kernel
    configuration instead of the tuned one.
    """
    ep = epilogue if epilogue is not None else _default_epilogue()
    if not isinstance(ep, Epilogue):
        raise TypeError(f"epilogue must be a codetta Epilogue, got {type(ep).__name__}")
    a_order = _check_matrix("a", a, "M, K")
    w_order = _check_matrix("weight", weight, "N, K")
    if a.dtype != weight.dtype:
        raise TypeError(f"a and weight must share a dtype, got {a.dtype} and {weight.dtype}")
    if a.device != weight.device:
        raise ValueError(f"a is on {a.device}, weight on {weight.device}")
    if a.device.type not in ("cuda", "cpu"):
        raise ValueError(f"a: device {a.device} is not supported (cuda, or cpu)")
    if a.device.type == "cuda" and a.dtype == torch.float32:
        raise TypeError("a: float32 GEMMs are not served on the GPU (bfloat16 or float16); use torch.matmul")
    M, K = a.shape
    N, K2 = weight.shape
    if K != K2:
        raise ValueError(f"a is [M={M}, K={K}] but weight is [N={N}, K={K2}]: K must match")
    if N == 0 or K == 0:
        raise ValueError(f"N and K must be >= 1, got N={N}, K={K}")
    if ep.check is not None:
        ep.check(M, N)
    names = {op.name for op in ep.inputs}
    unknown = set(operands) - names
    if unknown:
        raise TypeError(
            f"epilogue {ep.name!r} takes no operand(s) {sorted(unknown)}; it takes {sorted(names)}"
        )
    missing = [op.name for op in ep.inputs if op.name not in operands]
    if missing:
        raise TypeError(f"epilogue {ep.name!r} needs operand(s) {missing}")
    inputs = [_check_operand(ep, op, operands[op.name], a, M, N) for op in ep.inputs]
    if config is not None and not isinstance(config, tuning.Config):
        raise TypeError(f"config must be a codetta Config, got {type(config).__name__}")

    on_cpu = a.device.type == "cpu"
    use_reference = on_cpu and (not interpreting() or _interpreter_cannot(a.dtype))
    if M == 0 or use_reference:
        cfg = config or tuning.INTERPRETER_CONFIG
    else:
        cfg = config or _pick_config(ep, a, weight, a_order, w_order, inputs, M, N, K)
    lay = Layout(cfg.block_m, cfg.block_n, cfg.sub_n)
    outputs = _alloc_outputs(ep, M, N, a.dtype, a.device, lay)
    if M > 0:
        if use_reference:
            _reference(ep, a, weight, inputs, outputs, cfg)
        else:
            _launch(a, weight, a_order, w_order, ep, inputs, outputs, M, N, K, cfg)
    if len(outputs) == 1:
        return outputs[0]
    return ep.result(*outputs)


__all__ = ["gemm", "interpreting"]
