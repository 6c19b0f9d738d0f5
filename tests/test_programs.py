"""Every primitive kind through a program: results against fp64 references."""

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope
from util import SHAPES, assert_within, rand

import codetta
from codetta import programs as pg
from codetta import reference as ref
from codetta.kernels import primitives as P
from codetta.kernels import tuning

CFG = tuning.INTERPRETER_CONFIG if not torch.cuda.is_available() else None


def _inputs(M, N, K, dtype, device):
    return rand(M, K, dtype=dtype, device=device), rand(N, K, dtype=dtype, device=device, scale=K**-0.5)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_residual_rms(M, N, K, dtype, device):
    """K1: tile load + tile stores + row vector + row partial reduction."""
    y, w = _inputs(M, N, K, dtype, device)
    res = rand(M, N, dtype=dtype, device=device)
    gamma = rand(N, dtype=torch.float32, device=device)
    out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma)
    x64, h64, ss64 = ref.residual_rms_chain(y.double(), w.double(), res.double(), gamma.double())
    # PyTorch in the same dtype: the unfused chain, the norm statistics in fp32
    x_t = res + y @ w.t()
    h_t = (x_t.float() * gamma).to(dtype)
    assert_within("x", out.x, x64, x_t)
    assert_within("h", out.h, h64, h_t)
    # sumsq is the sum of squares of the stream as stored (out.x), summed in fp32
    assert out.sumsq.dtype == torch.float32
    ss_ref = out.x.double().pow(2).sum(-1)
    assert_within("sumsq", out.sumsq.sum(1), ss_ref, out.x.float().pow(2).sum(-1))
    assert torch.allclose(ss_ref, ss64, rtol=0.05), "the stored stream is far from the exact one"


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_row_scale(M, N, K, dtype, device):
    """Column-vector load: out = acc * scale[m]."""
    y, w = _inputs(M, N, K, dtype, device)
    scale = torch.rand(M, device=device) + 0.5
    out = codetta.gemm(y, w, epilogue=pg.ROW_SCALE, scale=scale)
    want = (y.double() @ w.double().t()) * scale.double()[:, None]
    assert_within("out", out, want, ((y @ w.t()).float() * scale[:, None]).to(dtype))


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_mul_colsum(M, N, K, dtype, device):
    """Column partial reduction over M-tiles, finished by a sum."""
    y, w = _inputs(M, N, K, dtype, device)
    other = rand(M, N, dtype=dtype, device=device)
    out = codetta.gemm(y, w, epilogue=pg.MUL_COLSUM, other=other)
    acc64 = y.double() @ w.double().t()
    assert_within("out", out.out, acc64, y @ w.t())
    torch_cs = ((y @ w.t()).float() * other.float()).sum(0)
    assert_within("colsum", out.colsum.sum(0), (acc64 * other.double()).sum(0), torch_cs)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_tile_lse(M, N, K, dtype, device):
    """Stateful online max / sum-exp across sub-tiles, finished across N-tiles."""
    y, w = _inputs(M, N, K, dtype, device)
    scale = 3.0
    out = codetta.gemm(y, w, epilogue=pg.TILE_LSE, scale=scale)
    want = torch.logsumexp((y.double() @ w.double().t()) * scale, dim=1)
    torch_same = torch.logsumexp((y @ w.t()).float() * scale, dim=1)
    assert_within("lse", torch.logsumexp(out, dim=1), want, torch_same)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_rotate_pairs(M, N, K, dtype, device):
    """Pairwise transform of adjacent columns, with a per-row angle."""
    y, w = _inputs(M, N, K, dtype, device)
    angle = torch.rand(M, device=device, dtype=torch.float64) * 6.28
    cos, sin = angle.cos().float(), angle.sin().float()
    out = codetta.gemm(y, w, epilogue=pg.ROTATE_PAIRS, cos=cos, sin=sin)
    want = ref.rotate_pairs(y.double() @ w.double().t(), cos.double(), sin.double())
    torch_same = ref.rotate_pairs((y @ w.t()).float(), cos, sin).to(dtype)
    assert_within("out", out, want, torch_same)


def test_programs_deterministic(device):
    M, N, K = SHAPES[-1]
    y, w = _inputs(M, N, K, torch.float16, device)
    res = rand(M, N, dtype=torch.float16, device=device)
    gamma = rand(N, dtype=torch.float32, device=device)
    a = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma)
    b = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma)
    for name in a._fields:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize(
    "operands,exc,match",
    [
        ({"gamma": "g"}, TypeError, "needs operand"),
        ({"residual": "r", "gamma": "g"}, TypeError, "'residual' must be a torch.Tensor"),
        ({"residual": "short", "gamma": "g"}, ValueError, "'residual' must have shape"),
        ({"residual": "ok", "gamma": "long"}, ValueError, "'gamma' must have shape"),
        ({"residual": "strided", "gamma": "g"}, ValueError, "'residual' must be row-contiguous"),
    ],
)
def test_bad_operands(operands, exc, match, device):
    M, N, K = 16, 32, 64
    y, w = _inputs(M, N, K, torch.float16, device)
    vals = {
        "g": torch.ones(N, device=device),
        "long": torch.ones(N + 1, device=device),
        "ok": rand(M, N, dtype=torch.float16, device=device),
        "short": rand(M - 1, N, dtype=torch.float16, device=device),
        "strided": rand(M, 2 * N, dtype=torch.float16, device=device)[:, ::2],
        "r": 1.0,
    }
    kwargs = {k: vals[v] for k, v in operands.items()}
    with pytest.raises(exc, match=match):
        codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, **kwargs)


def test_scalar_operand_type(device):
    y, w = _inputs(8, 32, 64, torch.float16, device)
    with pytest.raises(TypeError, match="'scale' must be a Python int or float"):
        codetta.gemm(y, w, epilogue=pg.TILE_LSE, scale=torch.tensor(1.0))


def test_rotate_pairs_odd_n(device):
    y, w = _inputs(8, 24, 64, torch.float16, device)
    cs = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="N must be even"):
        codetta.gemm(y, w[:23], epilogue=pg.ROTATE_PAIRS, cos=cs, sin=cs)


def _program_operands(name, M, N, device):
    dtype = torch.float16
    f32 = dict(device=device, dtype=torch.float32)
    return {
        "store": {},
        "row_scale": {"scale": torch.rand(M, **f32) + 0.5},
        "mul_colsum": {"other": rand(M, N, dtype=dtype, device=device)},
        "residual_rms": {"residual": rand(M, N, dtype=dtype, device=device), "gamma": torch.rand(N, **f32)},
        "residual_sumsq": {"residual": rand(M, N, dtype=dtype, device=device)},
        "gamma_weight_grad": {"gamma": torch.rand(N, **f32), "w": rand(M, N, dtype=dtype, device=device)},
        "rms_backward": {
            "x": rand(M, N, dtype=dtype, device=device),
            "dres": rand(M, N, dtype=dtype, device=device),
            "rstd": torch.rand(M, **f32) + 0.5,
            "zeta": torch.randn(M, **f32),
            "gamma": torch.rand(N, **f32),
            "inv_d": 1.0 / N,
        },
        "rms_grad_partials": {
            "x": rand(M, N, dtype=dtype, device=device),
            "rstd": torch.rand(M, **f32) + 0.5,
            "gamma": torch.rand(N, **f32),
        },
        "tile_lse": {"scale": 2.0},
        "rotate_pairs": {"cos": torch.rand(M, **f32), "sin": torch.rand(M, **f32)},
    }[name]


@pytest.mark.parametrize("name", [getattr(pg, n).name for n in pg.__all__])
def test_reference_path_matches_kernel(name, device, monkeypatch):
    """Each program's PyTorch reference (the CPU path without the interpreter)
    computes what its kernel computes."""
    from codetta.kernels import launch

    ep = next(getattr(pg, n) for n in pg.__all__ if getattr(pg, n).name == name)
    M, N, K = 77, 96, 64
    y, w = _inputs(M, N, K, torch.float16, device)
    ops = _program_operands(name, M, N, device)
    kernel = codetta.gemm(y, w, epilogue=ep, config=tuning.INTERPRETER_CONFIG, **ops)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    cpu_ops = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in ops.items()}
    reference = codetta.gemm(y.cpu(), w.cpu(), epilogue=ep, config=tuning.INTERPRETER_CONFIG, **cpu_ops)
    kernel = kernel if isinstance(kernel, tuple) else (kernel,)
    reference = reference if isinstance(reference, tuple) else (reference,)
    for out_k, out_r in zip(kernel, reference):
        assert out_k.shape == out_r.shape and out_k.dtype == out_r.dtype
        tol = 2e-3 if out_k.dtype == torch.float16 else 1e-4
        torch.testing.assert_close(
            out_k.cpu().float(), out_r.float(), rtol=tol, atol=tol * out_r.abs().max().item()
        )


def test_program_without_reference_on_cpu(monkeypatch):
    """A program with no PyTorch reference says so on the CPU path instead of crashing."""
    from codetta.kernels import launch

    bare = codetta.Epilogue("bare_store", pg.STORE.apply, outputs=pg.STORE.outputs)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    y, w = _inputs(8, 32, 64, torch.float16, "cpu")
    with pytest.raises(NotImplementedError, match="no PyTorch reference"):
        codetta.gemm(y, w, epilogue=bare)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "has space"}, "identifier"),
        ({"outputs": ()}, "no outputs"),
        ({"acc_init": "nope"}, "not a tile input"),
        ({"inputs": (codetta.Operand("x", codetta.Kind.ROW_PARTIAL),)}, "cannot be"),
    ],
)
def test_bad_epilogue_declarations(kwargs, match):
    base = {"name": "p", "apply": pg.STORE.apply, "outputs": pg.STORE.outputs}
    with pytest.raises(ValueError, match=match):
        codetta.Epilogue(**{**base, **kwargs})


@triton.jit
def _activations(acc, off_m, off_n, M, N, ops, state):
    """gelu = gelu_tanh(acc); silu = silu(acc); rowsum[m] = sum_n acc (one sub-tile spans N)."""
    gelu_out, silu_out, rowsum = ops
    P.store_tile(gelu_out, P.gelu_tanh(acc), off_m, off_n)
    P.store_tile(silu_out, P.silu(acc), off_m, off_n)
    P.store_col_vector(rowsum, P.row_sum(acc, off_n, N), off_m, M)
    return state


def _activations_ref(acc, lay, **_):
    import torch.nn.functional as F

    return {"gelu": F.gelu(acc, approximate="tanh"), "silu": F.silu(acc), "rowsum": acc.sum(1)}


ACTIVATIONS = codetta.Epilogue(
    "test_activations",
    _activations,
    outputs=(
        codetta.Operand("gelu", codetta.Kind.TILE),
        codetta.Operand("silu", codetta.Kind.TILE),
        codetta.Operand("rowsum", codetta.Kind.COL),
    ),
    reference=_activations_ref,
)


def test_elementwise_primitives_and_col_store(dtype, device):
    """gelu_tanh, silu and a per-row vector store, on a product whose N fits one sub-tile."""
    import torch.nn.functional as F

    M, K = 77, 64
    N = 16 if device == "cpu" else 64
    # one sub-tile spans all N columns, so the per-row store has one writer
    cfg = tuning.Config(32, N, 32, 2, 1, 1, 4) if device == "cpu" else tuning.Config(128, N, 64, 8, 1, 3, 4)
    y, w = _inputs(M, N, K, dtype, device)
    out = codetta.gemm(y, w, epilogue=ACTIVATIONS, config=cfg)
    acc64 = y.double() @ w.double().t()
    acc_t = (y @ w.t()).float()
    assert_within(
        "gelu", out.gelu, F.gelu(acc64, approximate="tanh"), F.gelu(acc_t, approximate="tanh").to(dtype)
    )
    assert_within("silu", out.silu, F.silu(acc64), F.silu(acc_t).to(dtype))
    assert_within("rowsum", out.rowsum, acc64.sum(1), acc_t.sum(1))
