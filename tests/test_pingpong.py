"""The sm_90 ping-pong mainloop (Gluon): every program that has one, every layout, odd
shapes, NaN-poisoned outputs, determinism. GPU only (Gluon has no interpreter path);
on the CPU the kernels are compiled for sm_90a in test_sass.py, and the launcher's
refusals are checked here."""

import pytest
import torch
from conftest import ON_GPU
from test_gemm import LAYOUTS
from test_gemm import _make as make_operands
from util import SHAPES, assert_within, rand

import codetta
from codetta import programs as pg
from codetta import reference as ref
from codetta.kernels import launch, tuning

PP = tuning.PINGPONG_CANDIDATES
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")


def _make(M, N, K, dtype, layout):
    return make_operands(M, N, K, dtype, "cuda", layout, w_scale=K**-0.5)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("cfg", PP, ids=lambda c: c.short())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_plain(M, N, K, layout, cfg):
    dtype = torch.bfloat16
    if layout[0] == "t" and (M * 2) % 16:
        pytest.skip("a transposed view needs M * itemsize to be a multiple of 16")
    a, w = _make(M, N, K, dtype, layout)
    out = codetta.gemm(a, w, config=cfg)
    assert_within("out", out, a.double() @ w.double().t(), a @ w.t())


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_residual_rms(M, N, K, dtype):
    y, w = _make(M, N, K, dtype, "nn")
    res = rand(M, N, dtype=dtype, device="cuda")
    gamma = rand(N, dtype=torch.float32, device="cuda")
    out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma, config=PP[0])
    x64, h64, _ = ref.residual_rms_chain(y.double(), w.double(), res.double(), gamma.double())
    x_t = res + y @ w.t()
    assert_within("x", out.x, x64, x_t)
    assert_within("h", out.h, h64, (x_t.float() * gamma).to(dtype))
    assert out.sumsq.shape == (M, -(-N // PP[0].block_n))
    assert_within("sumsq", out.sumsq.sum(1), out.x.double().pow(2).sum(-1), out.x.float().pow(2).sum(-1))
    # the stored stream and h are those of the Triton mainloop, up to fp32 summation order
    tl_out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma)
    assert (out.x.float() - tl_out.x.float()).abs().max() <= (x64.abs().max() * 2**-7).item()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_residual_sumsq(M, N, K):
    y, w = _make(M, N, K, torch.bfloat16, "nn")
    res = rand(M, N, dtype=torch.bfloat16, device="cuda")
    out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_SUMSQ, residual=res, config=PP[1])
    x64 = res.double() + y.double() @ w.double().t()
    assert_within("x", out.x, x64, res + y @ w.t())
    assert_within("sumsq", out.sumsq.sum(1), out.x.double().pow(2).sum(-1), out.x.float().pow(2).sum(-1))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_row_scale(M, N, K):
    y, w = _make(M, N, K, torch.bfloat16, "nn")
    scale = torch.rand(M, device="cuda") + 0.5
    out = codetta.gemm(y, w, epilogue=pg.ROW_SCALE, scale=scale, config=PP[0])
    want = (y.double() @ w.double().t()) * scale.double()[:, None]
    assert_within("out", out, want, ((y @ w.t()).float() * scale[:, None]).to(torch.bfloat16))


@pytest.mark.gpu
@hopper
def test_deterministic():
    M, N, K = SHAPES[-1]
    y, w = _make(M, N, K, torch.bfloat16, "nn")
    res = rand(M, N, dtype=torch.bfloat16, device="cuda")
    gamma = torch.rand(N, device="cuda")
    one = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma, config=PP[0])
    two = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma, config=PP[0])
    for name, a, b in zip(one._fields, one, two):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("fold_gamma", [False, True])
def test_operator_on_pingpong(monkeypatch, fold_gamma):
    """The residual + RMSNorm operator, forward and backward, with every program that
    has an sm90 function run on the ping-pong mainloop."""
    from test_residual_rmsnorm import check_operator

    real = launch.candidate_configs
    monkeypatch.setattr(
        launch, "candidate_configs", lambda ep: list(PP[:1]) + real(ep) if ep.sm90 is not None else real(ep)
    )
    monkeypatch.setattr(launch, "_CHOSEN", {})
    monkeypatch.setenv("CODETTA_AUTOTUNE", "0")
    check_operator(1000, 2048, 2048, 4096, torch.bfloat16, "cuda", fold_gamma=fold_gamma)


def test_refused_off_hopper():
    """Asking for the ping-pong mainloop where it cannot run names the reason."""
    if HOPPER:
        pytest.skip("runs where the ping-pong mainloop is unavailable")
    a, w = rand(64, 64, dtype=torch.float16, device="cpu"), rand(64, 64, dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="ping-pong"):
        codetta.gemm(a, w, config=PP[0])


def test_unsupported_reasons():
    a = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert "no sm90" in launch.pingpong_unsupported(pg.MUL_COLSUM, a)
    assert launch.pingpong_unsupported(pg.RESIDUAL_RMS, a) is not None  # a CPU tensor
    assert pg.STORE.sm90 is not None and pg.RESIDUAL_RMS.sm90 is not None


def test_config_round_trip():
    for cfg in PP:
        assert tuning.config_from_dict(cfg.__dict__) == cfg
    with pytest.raises(ValueError, match="ping-pong"):
        tuning.config_from_dict({**PP[0].__dict__, "block_n": 256})
