"""Compile the mainloop with an epilogue program for sm_90a without a GPU.

Used by CI to catch, before any GPU time is spent, a configuration that does
not compile, does not use wgmma or TMA loads, or spills registers to local
memory. wgmma and TMA are read from the PTX (``wgmma.mma_async``,
``cp.async.bulk.tensor`` global to shared: ptxas turns them into ``HGMMA`` and
``UTMALDG``, never into anything else; disassembling the SASS to look for those
took ~0.55 s per kernel, a fifth of the check's time); registers, spills and
shared memory from the cubin (``cuobjdump --dump-resource-usage``). Whether ptxas
serialized the wgmma pipeline, which the PTX cannot show (``wgmma_serialized``: a failure
for ping-pong kernels, shipped picks and portable tails, not read for the Triton mainloop's
other candidates), is read from ptxas's own report (``-v``: its C7514 / C7515 "wgmma.mma_async
instructions are serialized") where this process ran ptxas or kept its report beside
Triton's cache (under the cubin's hash), else from the SASS (~0.4 s a kernel): the two
readings agreed on all 634 kernels of the full check, 8 of them serialized (NOTES.md,
section "Session 54"). Tools come from
triton's own package (ptxas, cuobjdump).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import multiprocessing
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .configs import PINGPONG_TAIL_SPLIT, Config, fits, pingpong_tail_config
from .engines import PINGPONG, TRITON, tail_allowed
from .mainloop import gemm_kernel
from .pingpong import MAXNREG, pingpong_kernel
from .program import MAX_OPERANDS, STORE, Kind, Program
from .settings import override

_SERIAL = "ptxas serialized the wgmma"


@functools.cache
def _shipped_picks() -> frozenset:
    """(program name, Config) of every entry in the shipped tables the compiled target (sm_90,
    132 SMs: H100 SXM, H200) would use: each such GPU's own table over the others'."""
    from .tuning import shipped_gpus, shipped_table

    gpus = [g for g, ident in sorted(shipped_gpus().items())
            if list(ident.get("capability", ())) == [9, 0] and ident.get("num_sms") == 132]  # fmt: skip
    return frozenset((key.split("@")[0], cfg) for gpu in gpus
                     for key, cfg in shipped_table(gpu, (9, 0), 132).items())  # fmt: skip


def _runs_shipped(program, cfg) -> bool:
    """Whether a shipped table's entry makes ``program`` run ``cfg``: its own, or, for a
    program ``tuned_like`` another, that program's (its untuned keys take those picks)."""
    picks = _shipped_picks()
    like = program.tuned_like
    return (program.name, cfg) in picks or (like is not None and (like.name, cfg) in picks)


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
    wgmma_serialized: bool = False

    def problems(self) -> list[str]:
        out = []
        if not self.has_hgmma:
            out.append("no wgmma.mma_async (HGMMA) in the PTX")
        if self.wgmma_serialized:
            out.append(f"{_SERIAL} (a WARPGROUP.ARRIVE before every HGMMA: its C7514 / C7515)")
        if not self.has_tma_load:
            out.append("no cp.async.bulk.tensor load (UTMALDG, TMA) in the PTX")
        if self.stack_bytes or self.local_bytes:
            out.append(f"spills: {self.stack_bytes} B stack frame, {self.local_bytes} B local memory")
        return out


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


def _in_kinds(program: Program) -> tuple:
    # a representative table width for RowTable inputs (a launch fills the real one)
    return tuple((k, s, i, 64 if k == Kind.ROW_TABLE else w) for k, s, i, w in program.in_kinds)


def compile_sm90(program: Program, cfg: Config, dtype=torch.bfloat16, a_t=False, b_t=False, num_sms=132,
                 tail_only: bool = False):  # fmt: skip
    """Compile one kernel variant for sm_90a with the engine's own signature and
    constexprs (those a launch uses); return triton's compiled kernel. ``tail_only``:
    the portable kernel as a ping-pong launch's split tail runs it (``TAIL_ONLY``)."""
    if cfg.pingpong:
        from triton.experimental.gluon._runtime import GluonASTSource

        signature = PINGPONG.signature(program, cfg, dtype, a_t, b_t)
        constexprs = PINGPONG.constexprs(program, _in_kinds(program), cfg, dtype, a_t, b_t)
        constexprs.update({f"o{i}": None for i in range(len(program.slots), MAX_OPERANDS)})
        src = GluonASTSource(pingpong_kernel, signature, constexprs, _aligned_attrs(signature, constexprs))
        options = {"num_warps": cfg.num_warps, "maxnreg": MAXNREG}
    else:
        signature = TRITON.signature(program, cfg, dtype, a_t, b_t)
        constexprs = TRITON.constexprs(
            program, _in_kinds(program), cfg, dtype, a_t, b_t, num_sms * cfg.occupancy
        )
        constexprs["TAIL_ONLY"] = tail_only
        constexprs.update({f"o{i}": None for i in range(len(program.slots), MAX_OPERANDS)})
        src = ASTSource(gemm_kernel, signature, constexprs, _aligned_attrs(signature, constexprs))
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return _compile(src, options)


_SERIAL_LOG = re.compile(r"wgmma\.mma_async instructions are serialized")


def _kept_log(cubin: bytes) -> Path:
    """Where the ptxas report of a cubin is kept, beside Triton's cache."""
    return Path(knobs.cache.dir) / "codetta-ptxas" / (hashlib.sha256(cubin).hexdigest() + ".log")


def _compile(src, options):
    """``triton.compile`` for sm_90a, with ptxas's ``-v`` report as the kernel's
    ``ptxas_log``: the one ptxas printed here, else (a kernel from Triton's cache) the one
    kept beside that cache under the cubin's hash when it was compiled, else None."""
    out = io.StringIO()
    before = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True  # (Triton prints the report it always asks ptxas for)
    try:
        with contextlib.redirect_stdout(out):
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    finally:
        knobs.nvidia.dump_ptxas_log = before
    text = out.getvalue()
    kept = _kept_log(kernel.asm["cubin"])
    if "ptxas info" in text:
        kernel.ptxas_log = text
        with contextlib.suppress(OSError):  # (a read-only cache: the SASS is read next time)
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(kept)
    else:
        try:
            kernel.ptxas_log = kept.read_text()
        except OSError:
            kernel.ptxas_log = None
    return kernel


def compile_kernel_sm90(fn, signature: dict, constexprs: dict, num_warps: int):
    """Compile any ``@triton.jit`` kernel (a row pass) for sm_90a: ``signature`` maps each
    argument to its type ("*bf16", "i32", "fp32", or "constexpr" with its value in
    ``constexprs``); a type ending in ":16" (``"*bf16:16"``, ``"i32:16"``) is specialised as
    divisible by 16, as the GPU's launcher does for aligned pointers and sizes (some
    compiler failures show only then)."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.endswith(":16")}
    signature = {a: t.removesuffix(":16") for a, t in signature.items()}
    src = ASTSource(fn, signature, constexprs, attrs)
    return _compile(src, {"num_warps": num_warps})


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::(cluster|cta)\.global")  # (newer PTX: ::cta)
_TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")


def ptx_features(ptx: str) -> tuple[bool, bool, bool]:
    """(wgmma, TMA load, TMA store) present in a kernel's PTX."""
    return "wgmma.mma_async" in ptx, _TMA_LOAD.search(ptx) is not None, _TMA_STORE.search(ptx) is not None


def inspect(kernel, name: str, sass: bool = True) -> Report:
    """A compiled kernel's instructions (from its PTX) and resource use (from its cubin);
    ``sass``: also whether ptxas serialized its wgmma (from ptxas's report where the kernel
    has one, ``_compile``; else from the SASS, ~0.4 s a kernel)."""
    wgmma, tma_load, tma_store = ptx_features(kernel.asm["ptx"])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        res = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
        log = getattr(kernel, "ptxas_log", None)
        serialized = False
        if wgmma and sass and log is not None:
            serialized = _SERIAL_LOG.search(log) is not None
        elif wgmma and sass:  # (the SASS for the wgmma pipeline's reading: row passes have none)
            code = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
            serialized = wgmma_serialized(code)

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
        has_hgmma=wgmma,
        has_tma_load=tma_load,
        has_tma_store=tma_store,
        wgmma_serialized=serialized,
    )


def wgmma_serialized(sass: str) -> bool:
    """Whether ptxas serialized a kernel's wgmma: where it finds a non-wgmma instruction
    reading an accumulator inside a wgmma pipeline stage it waits for every HGMMA before the
    next (its info message C7514, "Potential Performance Loss"), seen in the SASS as a
    WARPGROUP.ARRIVE before each HGMMA instead of one per group of them. ce_logits in fp16
    ran at half speed so (run 216, NOTES.md)."""
    hgmma = len(re.findall(r"\bHGMMA\.", sass))
    return hgmma > 2 and sass.count("WARPGROUP.ARRIVE") >= hgmma


_JOBS: list = []  # check_all's jobs, inherited by its forked workers (programs do not pickle)


def _check_one(i: int) -> tuple[str, list[str]]:
    """Compile and inspect job i; (its report line, its problems)."""
    program, cfg, dtype, a_t, b_t, tail_only = (*_JOBS[i], False)[:6]
    name = f"{program.name} {cfg.short()} {str(dtype)[6:]} {'t' if a_t else 'n'}{'t' if b_t else 'n'}"
    name += " (ping-pong tail)" if tail_only else ""
    shipped = _runs_shipped(program, cfg)
    # the SASS read (a serialized wgmma fails the check) for ping-pong kernels, shipped picks
    # and portable tails; not for the Triton mainloop's other candidates, for the check's
    # time (the paired programs' flattened loops serialize in both dtypes: NOTES.md)
    strict = cfg.pingpong or shipped or tail_only
    try:
        rep = inspect(compile_sm90(program, cfg, dtype, a_t, b_t, tail_only=tail_only), name, sass=strict)
    except Exception as exc:  # noqa: BLE001 - any compile failure is a finding
        return f"{name}: does not compile", [f"{name}: does not compile: {str(exc).splitlines()[-1][:300]}"]
    found = rep.problems()
    note = ""
    if tail_only and rep.stack_bytes:
        # the launcher then runs the ping-pong config unsplit (PingPongEngine.launch)
        note = f" (spills {rep.stack_bytes} B: its ping-pong config runs unsplit)"
        found = [p for p in found if "spill" not in p]
    elif cfg.tail_split > 1 and (rep.stack_bytes or rep.local_bytes):
        # the launcher runs a config whose tail path spills unsplit: check that kernel instead
        note = f" (tail split spills {rep.stack_bytes} B: runs unsplit)"
        cfg = dataclasses.replace(cfg, tail_split=1)
        rep = inspect(compile_sm90(program, cfg, dtype, a_t, b_t), name, sass=strict)
        found = rep.problems()
    if not fits(cfg, rep.shared, rep.n_regs):
        found.append(f"{cfg.occupancy} block(s) of {rep.shared} B shared, {rep.n_regs} regs do not fit an SM")
    line = f"{name}: {rep.n_regs} regs, {rep.shared} B smem, {'; '.join(found) or 'ok'}{note}"
    return line, [f"{name}: {p}" for p in found]


def _heaviest(cfg: Config) -> tuple:
    # the likeliest of a mainloop's candidates to spill or overflow shared memory: the most
    # accumulator per warp, then the widest epilogue sub-tile, the deepest ring, flattened
    return (cfg.block_m * cfg.block_n // cfg.num_warps, cfg.sub_n, cfg.num_stages, cfg.flatten, cfg.short())


def candidates(program, engine, every: bool = True) -> list:
    """``engine``'s candidate configs of ``program`` the check compiles: all of them, or
    (``every=False``, CI's scope) the ones a shipped table runs plus the heaviest of the
    rest (``_heaviest``), so a program body that makes large tiles spill still fails."""
    cands = engine.candidates(program)
    if every:
        return cands
    shipped = [c for c in cands if _runs_shipped(program, c)]
    rest = [c for c in cands if c not in shipped]
    return shipped + ([max(rest, key=_heaviest)] if rest else [])


def check_all(programs, layouts=((False, False), (True, False), (False, True), (True, True)), workers=None,
              every: bool = True):  # fmt: skip
    """Compile every candidate config of every program on both mainloops (bf16), in fp16
    the shipped picks (first layout), and
    every layout of the plain store in bf16 and fp16, in ``workers`` processes (default:
    one per CPU); return one line per problem found. ``every=False``: of the candidates
    only the shipped picks and each mainloop's heaviest other one (``candidates``; about
    two thirds of the kernels: the CPU suite's scope, NOTES.md section "Session 54")."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [
        (program, cfg, torch.bfloat16, a_t, b_t)
        for program in programs
        for cfg in candidates(program, TRITON, every) + candidates(program, PINGPONG, every)
        for a_t, b_t in program.layouts
    ]
    for cfg in (TRITON.candidates(STORE)[0], PINGPONG.candidates(STORE)[0]):
        jobs += [(STORE, cfg, dt, a_t, b_t) for dt in (torch.bfloat16, torch.float16) for a_t, b_t in layouts]
    # fp16 (first layout): the shipped picks of both mainloops (fp16 calls take bf16 picks),
    # where fp16's packed converts made ptxas serialize the wgmma when bf16's did not
    # (ce_logits, residual_rms: run 216)
    jobs += [
        (program, cfg, torch.float16, *program.layouts[0])
        for program in programs
        for cfg in PINGPONG.candidates(program) + TRITON.candidates(program)
        if _runs_shipped(program, cfg)
    ]
    # CODETTA_TAIL_LAUNCH: the portable kernels that run the ping-pong candidates' split
    # tails, and the K-part programs' tail-split candidates (their K split across the parts)
    with override(tail_launch=True):
        for program in programs:
            if not tail_allowed(program):
                continue
            if program.k_parts_tail:
                jobs += [(program, c, torch.bfloat16, a_t, b_t) for c in candidates(program, TRITON, every)
                         if c.tail_split > 1 for a_t, b_t in program.layouts]  # fmt: skip
            tails = dict.fromkeys(
                pingpong_tail_config(dataclasses.replace(c, tail_split=PINGPONG_TAIL_SPLIT))
                for c in candidates(program, PINGPONG, every)
            )
            jobs += [
                (program, t, torch.bfloat16, a_t, b_t, True) for t in tails for a_t, b_t in program.layouts
            ]
    # (the ping-pong kernel takes GROUP_M at run time: candidates that differ only there,
    # configs.with_row_groups, are one binary, compiled once)
    one = {}
    for job in jobs:
        program, cfg, *rest = job
        key = (id(program), dataclasses.replace(cfg, group_m=8) if cfg.pingpong else cfg, *rest)
        one.setdefault(key, job)
    jobs = list(one.values())
    _JOBS[:] = jobs
    problems = []
    with ProcessPoolExecutor(
        workers or os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")
    ) as pool:
        for line, found in pool.map(_check_one, range(len(jobs))):
            print(line, flush=True)
            problems += found
    return problems
