"""Compile the mainloop with an epilogue program for sm_90a without a GPU.

Used by CI to catch, before any GPU time is spent, a configuration that does
not compile, does not use wgmma (``HGMMA``) or TMA (``UTMALDG``), or spills
registers to local memory. Tools come from triton's own package (ptxas,
cuobjdump).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .mainloop import MAX_OPERANDS, gemm_kernel
from .program import Epilogue, Kind
from .tuning import Config

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class Report:
    name: str
    n_regs: int
    stack_bytes: int
    shared: int
    local_bytes: int
    has_hgmma: bool
    has_tma_load: bool
    has_tma_store: bool

    def problems(self) -> list[str]:
        out = []
        if not self.has_hgmma:
            out.append("no HGMMA (wgmma) in the SASS")
        if not self.has_tma_load:
            out.append("no UTMALDG (TMA load) in the SASS")
        if self.stack_bytes or self.local_bytes:
            out.append(f"spills: {self.stack_bytes} B stack frame, {self.local_bytes} B local memory")
        return out


def _operand_types(ep: Epilogue, dtype, cfg: Config) -> tuple:
    tys = []
    for i, op in enumerate(ep.inputs + ep.outputs):
        if op.kind is Kind.TILE:
            ty = _TY[op.dtype] if op.dtype is not None else _TY[dtype]
            width = cfg.block_n if i == ep.acc_init_index else cfg.sub_n
            tys.append(f"tensordesc<{ty}[{cfg.block_m}, {width}]>")
        elif op.kind is Kind.SCALAR:
            tys.append("fp32")
        else:
            ty = _TY[op.dtype] if op.dtype is not None else "fp32"
            tys.append(f"*{ty}")
    return tuple(tys)


def _aligned_attrs(signature: dict, constexprs: dict) -> dict:
    """Mark the constexprs in ``signature``; return the attributes a launch on aligned
    shapes gets: M, N, K and every pointer divisible by 16 (register use, and so
    spills, can depend on it)."""
    for k in constexprs:
        signature[k] = "constexpr"
    names = list(signature)
    return {
        (names.index(k),): [["tt.divisibility", 16]]
        for k, ty in signature.items()
        if k in ("M", "N", "K") or ty.startswith("*")
    }


def _compile_pingpong(ep: Epilogue, cfg: Config, dtype, a_t: bool, b_t: bool):
    """Compile the ping-pong mainloop (Gluon) with the program's sm90 function for sm_90a."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc
    from triton.runtime.jit import mangle_type

    from . import pingpong

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    dummy = torch.empty(256, 256, dtype=dtype)

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        return mangle_type(GluonDesc.from_tensor(dummy, block, layout))

    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    signature = {
        "a_desc": desc([bk, bm] if a_t else [bm, bk]),
        "b_desc": desc([bk, bn] if b_t else [bn, bk]),
        "M": "i32", "N": "i32", "K": "i32", "GROUP_M": "i32",
    }  # fmt: skip
    ops = ep.inputs + ep.outputs
    for i in range(pingpong.MAX_OPERANDS):
        if i >= len(ops):
            signature[f"o{i}"] = "constexpr"
        elif ops[i].kind is Kind.TILE:
            signature[f"o{i}"] = desc([bm, bn])
        elif ops[i].kind is Kind.SCALAR:
            signature[f"o{i}"] = "fp32"
        else:
            signature[f"o{i}"] = "*" + (_TY[ops[i].dtype] if ops[i].dtype is not None else "fp32")
    constexprs = {f"o{i}": None for i in range(len(ops), pingpong.MAX_OPERANDS)}
    constexprs.update(
        NUM_OPS=len(ops), ACC_INIT=ep.acc_init_index, EPI=ep.sm90, BUF_DTYPE=gl_dtype,
        BUF_LAYOUT=gl.NVMMASharedLayout.get_default_for([bm, bn], gl_dtype), A_T=a_t, B_T=b_t,
        STAGES=cfg.num_stages, CONSUMER_REGS=pingpong.CONSUMER_REGS,
    )  # fmt: skip
    attrs = _aligned_attrs(signature, constexprs)
    src = GluonASTSource(pingpong.pingpong_kernel, signature, constexprs, attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": cfg.num_warps, "maxnreg": pingpong.MAXNREG},
    )


def compile_sm90(ep: Epilogue, cfg: Config, dtype=torch.bfloat16, a_t=False, b_t=False, num_sms=132):
    """Compile one kernel variant for sm_90a; return triton's compiled kernel."""
    if cfg.pingpong:
        return _compile_pingpong(ep, cfg, dtype, a_t, b_t)
    t = _TY[dtype]
    a_block = [cfg.block_k, cfg.block_m] if a_t else [cfg.block_m, cfg.block_k]
    b_block = [cfg.block_k, cfg.block_n] if b_t else [cfg.block_n, cfg.block_k]
    signature = {
        "a_desc": f"tensordesc<{t}[{a_block[0]}, {a_block[1]}]>",
        "b_desc": f"tensordesc<{t}[{b_block[0]}, {b_block[1]}]>",
        "M": "i32",
        "N": "i32",
        "K": "i32",
    }
    tys = _operand_types(ep, dtype, cfg)
    for i in range(MAX_OPERANDS):
        signature[f"o{i}"] = tys[i] if i < len(tys) else "constexpr"
    signature.update({"ws_ptr": "*fp32", "counts_ptr": "*i32", "tail_splits": "i32"})
    constexprs = {f"o{i}": None for i in range(len(tys), MAX_OPERANDS)}
    constexprs.update(
        {
            "NUM_OPS": len(tys),
            "ACC_INIT": ep.acc_init_index,
            "EPI_APPLY": ep.apply,
            "EPI_INIT": ep.init,
            "EPI_FINISH": ep.finish,
            "A_T": a_t,
            "B_T": b_t,
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m,
            "EPI_SPLIT": cfg.epi_split,
            "NUM_SMS": num_sms * cfg.occupancy,
            "FLATTEN": cfg.flatten,
            "WARP_SPECIALIZE": cfg.warp_specialize,
            "IEEE": dtype == torch.float32,
            "TAIL_SPLIT": cfg.tail_split,
        }
    )
    src = ASTSource(gemm_kernel, signature, constexprs, _aligned_attrs(signature, constexprs))
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def inspect(kernel, name: str) -> Report:
    """Disassemble a compiled kernel and read its resource use."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run(
            [_tool("cuobjdump"), "--dump-sass", path], capture_output=True, text=True, check=True
        ).stdout
        res = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout

    def field(key):
        m = re.search(key + r":(\d+)", res)
        if m is None:
            raise RuntimeError(f"cuobjdump reported no {key} for {name}:\n{res}")
        return int(m.group(1))

    return Report(
        name=name,
        n_regs=field("REG"),
        stack_bytes=field("STACK"),
        shared=kernel.metadata.shared,
        local_bytes=field("LOCAL"),
        has_hgmma="HGMMA" in sass,
        has_tma_load="UTMALDG" in sass,
        has_tma_store="UTMASTG" in sass,
    )


def check_all(programs, layouts=((False, False), (True, False), (False, True), (True, True))) -> list[str]:
    """Compile every candidate config of every program (bf16), and every layout of
    the plain store in bf16 and fp16; return one line per problem found."""
    from ..programs import STORE
    from .launch import candidate_configs
    from .tuning import fits

    jobs = [
        (ep, cfg, torch.bfloat16, a_t, b_t)
        for ep in programs
        for cfg in candidate_configs(ep)
        for a_t, b_t in ep.layouts
    ]
    cfg0 = candidate_configs(STORE)[0]
    jobs += [(STORE, cfg0, dt, a_t, b_t) for dt in (torch.bfloat16, torch.float16) for a_t, b_t in layouts]
    problems = []
    for ep, cfg, dtype, a_t, b_t in jobs:
        name = f"{ep.name} {cfg.short()} {_TY[dtype]} {'t' if a_t else 'n'}{'t' if b_t else 'n'}"
        try:
            rep = inspect(compile_sm90(ep, cfg, dtype, a_t, b_t), name)
        except Exception as exc:  # noqa: BLE001 - any compile failure is a finding
            problems.append(f"{name}: does not compile: {str(exc).splitlines()[-1][:300]}")
            continue
        found = rep.problems()
        note = ""
        if found and cfg.tail_split > 1:
            # the launcher runs a config whose tail path spills unsplit: check that kernel instead
            note = f" (tail split spills {rep.stack_bytes} B: runs unsplit)"
            cfg = dataclasses.replace(cfg, tail_split=1)
            rep = inspect(compile_sm90(ep, cfg, dtype, a_t, b_t), name)
            found = rep.problems()
        if not fits(cfg, rep.shared, rep.n_regs):
            found.append(
                f"{cfg.occupancy} block(s) of {rep.shared} B shared, {rep.n_regs} regs do not fit an SM"
            )
        print(f"{name}: {rep.n_regs} regs, {rep.shared} B smem, {'; '.join(found) or 'ok'}{note}", flush=True)
        problems += [f"{name}: {p}" for p in found]
    return problems


if __name__ == "__main__":
    import sys

    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the sm_90a compiler needs the real JIT functions")
    from .. import programs as pg

    bad = check_all([getattr(pg, n) for n in pg.__all__])
    print("\n".join(bad) if bad else "all sm_90a kernels: HGMMA + TMA, no spills, shared memory fits")
    sys.exit(1 if bad else 0)
