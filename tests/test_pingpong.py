"""The sm_90 ping-pong mainloop (Gluon) runs every program from the program's one body:
each shipped and test program, each of its ping-pong configurations, against fp64,
with NaN-poisoned outputs; every layout of the plain GEMM; determinism. GPU only
(Gluon has no interpreter path); on the CPU the kernels are compiled for sm_90a in
test_sass.py, and the launcher's refusals are checked here."""

import pytest
import torch
from conftest import ON_GPU
from test_gemm import LAYOUTS
from test_gemm import _make as make_operands
from test_programs import ACTIVATIONS, PICK_LSE, SWIGLU_PAIRS, TABLE_SCALE, _program_operands
from util import SHAPES, assert_within, rand

import codetta
from codetta import programs as pg
from codetta.kernels import configs
from codetta.kernels.engines import PINGPONG
from codetta.kernels.operands import make_call

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
PROGRAMS = [p for p in (getattr(pg, n) for n in pg.__all__) if p.pingpong] + [
    ACTIVATIONS,
    PICK_LSE,
    SWIGLU_PAIRS,
    TABLE_SCALE,
]
GPU_SHAPES = [(77, 2048, 1024), (1000, 1536, 2056)]


def _make(M, N, K, dtype, layout):
    return make_operands(M, N, K, dtype, "cuda", layout, w_scale=K**-0.5)


def _operands(prog, M, N, dtype, K=64):
    if prog is PICK_LSE:
        t = torch.randint(0, N, (M,), device="cuda")
        t[::5] = -100
        return {"target": t}
    if prog is TABLE_SCALE:
        return {
            "pos": torch.randint(0, 500, (M,), device="cuda"),
            "cos": torch.randn(500, 128, device="cuda"),
        }
    if prog in (ACTIVATIONS, SWIGLU_PAIRS):
        return {}
    ops = _program_operands(prog.name, M, N, "cuda", K)
    ops = {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.float16 else v
        for k, v in ops.items()
    }
    a_t, b_t = prog.layouts[0]
    as_a = (codetta.Kind.K_PART_A, codetta.Kind.M_PART)
    as_w = (codetta.Kind.K_PART_B, codetta.Kind.N_PART)
    for op in prog.inputs:  # parts laid out as the GEMM's A and weight
        if (op.kind in as_a and a_t) or (op.kind in as_w and b_t):
            ops[op.name] = ops[op.name].t().contiguous().t()
    return ops


def check_against_reference(prog, y, w, operands, outs):
    """Every output against the program's reference in fp64, within 2 x the error of the
    same reference run on PyTorch's own product in the GEMM's dtype."""
    acc64 = y.double() @ w.double().t()
    acc_t = (y @ w.t()).float()
    seed = next((op.name for op in prog.inputs if op.kind is codetta.Kind.SEED), None)
    pair = next((op.name for op in prog.inputs if op.kind is codetta.Kind.PAIRED_WEIGHT), None)
    extra = {op.name: y.dtype for op in prog.inputs if op.kind is codetta.Kind.DTYPE}
    if seed is not None:
        acc64 = acc64 + operands[seed].double()
        acc_t = (acc_t + operands[seed].float()).to(y.dtype).float()
    if prog.k_parts:  # K parts: their products summed into the accumulator; PyTorch's: one
        # product over the concatenated K
        ys = [y] + [operands[prog.slots[ia].name] for ia, _ in prog.k_parts]
        ws = [w] + [operands[prog.slots[iw].name] for _, iw in prog.k_parts]
        acc64 = sum(a.double() @ b.double().t() for a, b in zip(ys, ws))
        acc_t = (torch.cat(ys, 1) @ torch.cat(ws, 1).t()).float()
    if pair is not None:  # the body's acc is the pair of products (e.g. SwiGLU's gate and up)
        acc64 = (acc64, y.double() @ operands[pair].double().t())
        acc_t = (acc_t, (y @ operands[pair].t()).float())
    n_parts = [prog.slots[i].name for i in prog.n_parts]
    wparts = [operands[n] for n in n_parts]
    if n_parts:  # the weights side by side along N; each output's columns split back below
        wide = torch.cat([w, *wparts])
        acc64, acc_t = y.double() @ wide.double().t(), (y @ wide.t()).float()
    m_parts = [prog.slots[i].name for i in prog.m_parts]
    aparts = [operands[n] for n in m_parts]
    if m_parts:  # the A operands stacked along M; each output's rows split back below
        tall = torch.cat([y, *aparts])
        acc64, acc_t = tall.double() @ w.double().t(), (tall @ w.t()).float()
    n_parts += m_parts
    ops64 = {
        k: v.double() if isinstance(v, torch.Tensor) and torch.is_floating_point(v) else v
        for k, v in operands.items()
        if k != pair and k not in n_parts
    }
    operands = {k: v for k, v in operands.items() if k != pair and k not in n_parts}
    want = prog.reference(acc64, **ops64, **extra)
    same = prog.reference(acc_t, **operands, **extra)
    if n_parts:
        bounds = [0]
        for t in [y, *aparts] if m_parts else [w, *wparts]:
            bounds.append(bounds[-1] + t.shape[0])

        def cut(t, i):
            return t[bounds[i] : bounds[i + 1]] if m_parts else t[:, bounds[i] : bounds[i + 1]]

        for res in (want, same):
            for op in prog.outputs:
                if op.kind is codetta.Kind.TILE_PART:
                    res[op.name] = cut(res[op.index], prog.part_number[op.name])
            for op in prog.outputs:
                if op.kind is codetta.Kind.TILE:
                    res[op.name] = cut(res[op.name], 0)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for op, out in zip(prog.outputs, outs):
        tile = op.is_tile or op.kind is codetta.Kind.TILE_PART
        assert out.dtype == (op.dtype or (y.dtype if tile else torch.float32)), op.name
        if op.split:  # RowLogSumExp(split=True): [2, M] (hi, lo), the log-sum-exp their sum
            assert out.shape == (2, want[op.name].shape[0]), op.name
            out = out.double().sum(0)
        assert_within(op.name, out, want[op.name], same[op.name].to(out.dtype))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("M,N,K", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("prog", PROGRAMS, ids=lambda p: p.name)
def test_program(prog, M, N, K):
    """Each program on each of its ping-pong configurations (the body's own math)."""
    dtype = torch.bfloat16
    a_t, b_t = prog.layouts[0]
    if a_t:
        M = -(-M // 8) * 8  # a transposed A's rows are M long: 16-byte multiples for TMA
    if prog.m_parts:
        M = 256  # the first A's rows end on a tile edge (the parts: test_programs' 128 and 40 rows)
    y, w = _make(M, N, K, dtype, ("t" if a_t else "n") + ("t" if b_t else "n"))
    operands = _operands(prog, M, N, dtype, K)
    call = make_call(prog, y, w, operands)
    assert PINGPONG.unsupported(call) is None
    for cfg in PINGPONG.candidates(prog):
        outs = codetta.gemm(y, w, epilogue=prog, config=cfg, **operands)
        check_against_reference(prog, y, w, operands, outs)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_plain_layouts(M, N, K, layout):
    dtype = torch.bfloat16
    if layout[0] == "t" and (M * 2) % 16:
        pytest.skip("a transposed view needs M * itemsize to be a multiple of 16")
    a, w = _make(M, N, K, dtype, layout)
    for cfg in configs.PINGPONG_CANDIDATES[:1] + configs.PINGPONG_STREAMING_CANDIDATES[-1:]:
        out = codetta.gemm(a, w, config=cfg)
        assert_within("out", out, a.double() @ w.double().t(), a @ w.t())


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_rms_fp16_and_bf16(dtype):
    M, N, K = SHAPES[2]
    y, w = _make(M, N, K, dtype, "nn")
    ops = {"residual": rand(M, N, dtype=dtype, device="cuda"), "gamma": torch.rand(N, device="cuda") + 0.5}
    for cfg in PINGPONG.candidates(pg.RESIDUAL_RMS):
        out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, config=cfg, **ops)
        check_against_reference(pg.RESIDUAL_RMS, y, w, ops, out)


@pytest.mark.gpu
@hopper
def test_deterministic():
    M, N, K = SHAPES[-1]
    y, w = _make(M, N, K, torch.bfloat16, "nn")
    res = rand(M, N, dtype=torch.bfloat16, device="cuda")
    gamma = torch.rand(N, device="cuda")
    cfg = PINGPONG.candidates(pg.RESIDUAL_RMS)[0]
    one = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma, config=cfg)
    two = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma, config=cfg)
    for name, a, b in zip(one._fields, one, two):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant", ["rowwise", "two_pass", "folded", "fold_gamma"])
def test_operator_on_pingpong(variant):
    """The residual + RMSNorm operator, forward and backward, with every GEMM on the
    ping-pong mainloop (its first candidate, untuned)."""
    from test_residual_rmsnorm import check_operator

    from codetta.kernels import settings, tuning

    kw = {"fold_gamma": True} if variant == "fold_gamma" else {"backward": variant}
    tuning.CHOOSER.clear()
    with settings.override(autotune=False, prefer_pingpong=True):
        check_operator(1000, 2048, 2048, 4096, torch.bfloat16, "cuda", **kw)
    tuning.CHOOSER.clear()


def test_refused_off_hopper():
    """Asking for the ping-pong mainloop where it cannot run names the reason."""
    if HOPPER:
        pytest.skip("runs where the ping-pong mainloop is unavailable")
    a, w = rand(64, 64, dtype=torch.float16, device="cpu"), rand(64, 64, dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="ping-pong"):
        codetta.gemm(a, w, config=configs.PINGPONG_CANDIDATES[0])


def test_unsupported_reasons():
    import dataclasses

    a = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert "CUDA" in PINGPONG.unsupported(make_call(pg.STORE, a, a, {}))
    off = dataclasses.replace(pg.STORE, name="store_no_pp", pingpong=False)
    assert "opts out" in PINGPONG.unsupported(make_call(off, a, a, {}))
    assert PINGPONG.candidates(off) == []


def test_config_round_trip():
    for cfg in configs.ALL_PINGPONG:
        assert configs.config_from_dict(cfg.__dict__) == cfg
    with pytest.raises(ValueError, match="ping-pong"):
        configs.config_from_dict({**configs.PINGPONG_CANDIDATES[0].__dict__, "block_n": 256})


def test_float32_seed_streams_through_two_slots():
    """A float32 ring whose program has one tile output and no other tile input keeps two
    sub-tiles per consumer (the seed streams through them), so 128x128 tiles get 4-5 A/B
    stages; other programs keep a whole tile's ring. (test_program runs every candidate on
    the GPU, test_sass.py compiles them for sm_90a on the CPU.)"""
    bf16 = torch.bfloat16
    by_split = {c.epi_split: c for c in PINGPONG.candidates(pg.ACCUMULATE_F32) if c.block_n == 128}
    assert PINGPONG.ring_slots(pg.ACCUMULATE_F32, by_split[4], bf16) == 2
    assert PINGPONG.ring_slots(pg.STORE_F32, by_split[4], bf16) == 2
    # a float32 seed finished in the GEMM's dtype: the same float32 ring, its output stored
    # through a slot viewed as bf16
    assert PINGPONG.ring_dtype(pg.FINISH_F32, bf16) == torch.float32
    assert PINGPONG.ring_slots(pg.FINISH_F32, by_split[4], bf16) == 2
    assert PINGPONG.ring_slots(pg.ACCUMULATE_F32, by_split[2], bf16) == 2  # = the split: nothing streams
    assert max(c.num_stages for c in PINGPONG.candidates(pg.ACCUMULATE_F32) if c.block_n == 128) == 5
    for prog in (pg.ACCUMULATE, pg.DSWIGLU, pg.STORE):
        for cfg in PINGPONG.candidates(prog):
            assert PINGPONG.ring_slots(prog, cfg, bf16) == cfg.epi_split, prog.name


# 64-row consumer tiles (configs.PINGPONG_64_ROW_CANDIDATES): Qwen3's q/k-norm + RoPE
# runs on them; any program can
ROWS_64 = configs.PINGPONG_64_ROW_CANDIDATES


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("prog", [pg.STORE, pg.RESIDUAL_RMS, pg.RMS_ROPE_128, pg.RMS_QKNORM_ROPE_128],
                         ids=lambda p: p.name)  # fmt: skip
def test_64_row_tiles(prog):
    """The ping-pong mainloop with 64x128 consumer tiles, against fp64."""
    import dataclasses

    M, N, K = 1000, 1536, 2056
    prog = dataclasses.replace(prog, pingpong=True, pingpong_configs=tuple(ROWS_64))
    y, w = _make(M, N, K, torch.bfloat16, "nn")
    operands = _operands(prog, M, N, torch.bfloat16, K)
    for cfg in ROWS_64:
        outs = codetta.gemm(y, w, epilogue=prog, config=cfg, **operands)
        check_against_reference(prog, y, w, operands, outs)


TAIL_PROGRAMS = [p for p in PROGRAMS if p.tail_split or p.k_parts_tail]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("prog", TAIL_PROGRAMS, ids=lambda p: p.name)
def test_tail_split(prog):
    """CODETTA_TAIL_LAUNCH=1: each ping-pong candidate also with its tail split (the last
    partial wave's tiles split along K on the portable mainloop after the ping-pong kernel
    ran the rest): against fp64, the same bits on a second call, the counters left at zero."""
    from codetta.kernels import engines, settings

    M, N, K = 3300, 768, 2056  # 156 tiles of 128x128 on 132 SMs: a tail of 24 (312 / 48 at 64 rows)
    dtype = torch.bfloat16
    a_t, b_t = prog.layouts[0]
    if a_t:
        M = -(-M // 8) * 8
    y, w = _make(M, N, K, dtype, ("t" if a_t else "n") + ("t" if b_t else "n"))
    operands = _operands(prog, M, N, dtype, K)
    call = make_call(prog, y, w, operands)
    with settings.override(tail_launch=True):
        cands = [c for c in PINGPONG.candidates(prog) if c.tail_split > 1]
        assert cands, "no tail-split candidates"
        for cfg in cands:
            assert PINGPONG.tail_plan(call, cfg) is not None, f"{cfg.short()}: no split at this shape"
            outs = codetta.gemm(y, w, epilogue=prog, config=cfg, **operands)
            check_against_reference(prog, y, w, operands, outs)
            again = codetta.gemm(y, w, epilogue=prog, config=cfg, **operands)
            for a, b in zip(outs if isinstance(outs, tuple) else (outs,),
                            again if isinstance(again, tuple) else (again,)):  # fmt: skip
                assert torch.equal(a, b), f"{cfg.short()}: the second call differs"
    assert not engines.tail_counters(y.device).any(), "a tail counter was left non-zero"
