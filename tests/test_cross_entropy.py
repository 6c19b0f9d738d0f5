"""codetta.ops.linear_cross_entropy against F.cross_entropy(F.linear(...)) in float64."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ON_GPU
from util import assert_within, rand

from codetta.ops import linear_cross_entropy
from codetta.ops.cross_entropy import rows_per_chunk

# (M, d, V, rows per chunk)
SHAPES = (
    [(77, 64, 1000, 32), (40, 32, 257, None)]
    if not ON_GPU
    else [(4000, 2048, 32000, 1024), (999, 4096, 128256, None), (1000, 2048, 50257, None)]
)


def _run(fn, x, w, t, reduction, grad=None):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w, t, reduction)
    g = torch.ones_like(loss) if grad is None else grad.to(loss.dtype)
    (loss.double() * g.double()).sum().backward()
    return loss.detach(), x.grad, w.grad


def _torch(x, w, t, reduction):
    return F.cross_entropy(F.linear(x, w).float(), t.long(), reduction=reduction).to(x.dtype)


def _check(M, d, V, rows, dtype, device, reduction, t, scale=1.0, grad=None):
    x = rand(M, d, dtype=dtype, device=device, scale=scale)
    w = rand(V, d, dtype=dtype, device=device, scale=d**-0.5)

    def fn(x, w, t, r):
        return linear_cross_entropy(x, w, t, reduction=r, chunk_rows=rows)

    ours = _run(fn, x, w, t, reduction, grad)

    def exact(x, w, t, r):
        return F.cross_entropy(F.linear(x, w), t.long(), reduction=r)

    want = _run(exact, x.double(), w.double(), t, reduction, grad)
    same = _run(_torch, x, w, t, reduction, grad)
    assert ours[0].dtype == dtype
    for name, a, b, c in zip(("loss", "dinput", "dweight"), ours, want, same):
        assert_within(name, a, b, c)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("M,d,V,rows", SHAPES, ids=str)
def test_matches_float64(M, d, V, rows, reduction, dtype, device):
    """Loss and both gradients, some targets ignored, int32 targets, several chunks;
    'none' with a non-uniform incoming gradient."""
    g = torch.Generator(device=device).manual_seed(0)
    t = torch.randint(0, V, (M,), device=device, generator=g, dtype=torch.int32)
    t[::7] = -100
    grad = torch.rand(M, device=device, generator=g) + 0.5 if reduction == "none" else None
    _check(M, d, V, rows, dtype, device, reduction, t, grad=grad)


def test_large_logits_and_3d_input(dtype, device):
    """Logits of large magnitude (|logit| ~ 30) and a [B, T, d] input."""
    M, d, V, rows = SHAPES[0]
    t = torch.randint(0, V, (M,), device=device)
    _check(M, d, V, rows, dtype, device, "mean", t, scale=30.0)
    x = rand(2, 5, d, dtype=dtype, device=device)
    w = rand(V, d, dtype=dtype, device=device, scale=d**-0.5)
    t3 = torch.randint(0, V, (2, 5), device=device)
    got = linear_cross_entropy(x, w, t3, reduction="none")
    assert got.shape == (2, 5)
    want = F.cross_entropy(F.linear(x.double(), w.double()).reshape(10, V), t3.reshape(-1), reduction="none")
    assert torch.allclose(got.double().reshape(-1), want, rtol=2e-2, atol=2e-2)


def test_all_ignored(device):
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    M, d, V, rows = SHAPES[0]
    x = rand(M, d, dtype=dtype, device=device).requires_grad_()
    w = rand(V, d, dtype=dtype, device=device, scale=d**-0.5).requires_grad_()
    t = torch.full((M,), -100, device=device)
    loss = linear_cross_entropy(x, w, t, chunk_rows=rows)
    assert torch.isnan(loss)  # 0 / 0, as torch
    assert linear_cross_entropy(x, w, t, reduction="sum", chunk_rows=rows).item() == 0.0
    linear_cross_entropy(x, w, t, reduction="sum", chunk_rows=rows).backward()
    assert not x.grad.any() and not w.grad.any()


def test_bad_input(device):
    x = rand(8, 32, dtype=torch.float16, device=device)
    w = rand(64, 32, dtype=torch.float16, device=device)
    t = torch.randint(0, 64, (8,), device=device)
    with pytest.raises(IndexError, match="target values"):
        linear_cross_entropy(x, w, torch.full_like(t, 64))
    with pytest.raises(TypeError, match="target must be"):
        linear_cross_entropy(x, w, t.float())
    with pytest.raises(ValueError, match="target must have shape"):
        linear_cross_entropy(x, w, t[:4])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="max")
    with pytest.raises(ValueError, match="multiple of 8"):
        linear_cross_entropy(rand(8, 36, dtype=torch.float16, device=device),
                             rand(64, 36, dtype=torch.float16, device=device), t)  # fmt: skip
    with pytest.raises(TypeError, match="linear_weight"):
        linear_cross_entropy(x, w.float(), t)


def test_chunk_budget():
    assert rows_per_chunk(16384, 128256, 2) == 1024  # 256 MiB of bf16 logits
    assert rows_per_chunk(100, 128256, 2) == 100
    assert rows_per_chunk(5000, 10**9, 2) == 1


def test_compile_fullgraph(device):
    """torch.compile traces the op (a custom op with a fake implementation), ignore_index included."""
    M, d, V, rows = SHAPES[1]
    x = rand(M, d, dtype=torch.float16, device=device).requires_grad_()
    w = rand(V, d, dtype=torch.float16, device=device, scale=d**-0.5).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    t[::3] = -100

    def f(x, w, t):
        return linear_cross_entropy(x, w, t, chunk_rows=rows)

    eager = f(x, w, t)
    got = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")(x, w, t)
    assert torch.equal(got, eager)
