"""Tied embeddings: the table's gradient from the LM head + loss and from the lookup in one
pass (programs/embedding.py, ops/tied_embedding.py), against float64 and against PyTorch
summing the two gradients itself; an untied lookup's gradient in one pass (the same
kernels without the head's term) against float64 and PyTorch's embedding backward."""

import importlib

import pytest
import torch
from conftest import ON_GPU
from util import assert_within

from codetta.ops import TiedLink, embedding, linear_cross_entropy, tied_embedding
from codetta.programs.embedding import (
    SEG,
    embedding_weight_grad,
    embedding_weight_grad_reference,
    tied_weight_grad,
    tied_weight_grad_reference,
)

tied_mod = importlib.import_module("codetta.ops.tied_embedding")  # (the package exports a function so named)

# (V, d, tokens, padding_idx, how the ids are drawn)
CASES = (
    [(50, 24, 37, None, "uniform"), (200, 72, 300, 3, "skewed"), (64, 40, 0, None, "uniform"),
     (96, 16, 3 * SEG + 5, None, "one")]
    if not ON_GPU
    else [(32000, 2048, 16384, None, "uniform"), (32000, 4096, 16384, 0, "skewed"),
          (50257, 1024, 8192, None, "one"), (1000, 520, 777, 7, "skewed")]
)  # fmt: skip


def _ids(V, T, pad, how, device):
    ids = torch.randint(0, V, (T,), device=device)
    if how == "skewed" and T:  # a frequent id (runs across several blocks) and the padding id
        ids[torch.rand(T, device=device) < 0.4] = 5
        if pad is not None:
            ids[torch.rand(T, device=device) < 0.2] = pad
    elif how == "one":  # every token the same id
        ids.fill_(V - 1)
    return ids


def _torch_tied(dw32, scale, g, ids, pad, dtype):
    """PyTorch's own path in ``dtype``: the head's gradient cast, the embedding's backward,
    their sum (autograd's)."""
    head = (dw32 * scale).to(dtype)
    emb = torch.ops.aten.embedding_dense_backward(g, ids, dw32.shape[0], -1 if pad is None else pad, False)
    return head + emb.to(dtype)


@pytest.mark.parametrize("V,D,T,pad,how", CASES)
def test_weight_grad_matches_float64(V, D, T, pad, how, dtype, device):
    dw32 = torch.randn(V, D, device=device) * 1e-2
    scale = torch.tensor(0.73, device=device)
    g = torch.randn(T, D, device=device).to(dtype)
    ids = _ids(V, T, pad, how, device)
    got = tied_weight_grad(dw32, scale, g, ids, pad, dtype)
    ref = tied_weight_grad_reference(dw32, scale, g, ids, pad)
    assert got.dtype == dtype and got.shape == (V, D)
    assert_within("dW", got, ref, _torch_tied(dw32, scale, g, ids, pad, dtype))
    if pad is not None:  # the padding row: the head's term alone
        assert torch.equal(got[pad], (dw32[pad] * scale).to(dtype))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("V,D,T,pad,how", CASES)
def test_untied_weight_grad_matches_float64(V, D, T, pad, how, sparse, dtype, device):
    """The lookup's gradient alone (no head term), either form of pass B: within twice
    PyTorch's own embedding backward's error; every row written (rows no token names, and
    the padding row, zero: under poisoned outputs, so an unwritten row cannot pass)."""
    from codetta.kernels import settings

    g = torch.randn(T, D, device=device).to(dtype)
    ids = _ids(V, T, pad, how, device)
    with settings.override(poison_outputs=True):
        got = embedding_weight_grad(g, ids, pad, V, dtype, sparse=sparse)
    ref = embedding_weight_grad_reference(g, ids, pad, V)
    theirs = torch.ops.aten.embedding_dense_backward(g, ids, V, -1 if pad is None else pad, False)
    assert got.dtype == dtype and got.shape == (V, D)
    assert_within("dW", got, ref, theirs)
    named = torch.zeros(V, dtype=torch.bool, device=device)
    named[ids] = True
    if pad is not None:
        named[pad] = False
    assert torch.equal(got[~named], torch.zeros_like(got[~named])), "a row no token names is not zero"


def test_embedding_op_matches_torch(dtype, device, monkeypatch):
    """``codetta.ops.embedding``: F.embedding's output bit for bit, its weight gradient from
    the one pass (it ran), within twice PyTorch's error; no gradient wanted: a plain lookup."""
    V, d, T = (80, 24, 50) if not ON_GPU else (32000, 4096, 8192)
    calls = []
    real = tied_mod.embedding_weight_grad
    monkeypatch.setattr(tied_mod, "embedding_weight_grad", lambda *a: calls.append(1) or real(*a))
    w0 = torch.randn(V, d, device=device)
    ids = torch.randint(0, V, (2, T // 2), device=device)
    ids[0, :3] = 1
    up = torch.randn(2, T // 2, d, device=device)
    grads = {}
    for name, dt in (("ours", dtype), ("torch", dtype), ("f64", torch.float64)):
        w = w0.to(dt).clone().requires_grad_()
        f = embedding if name == "ours" else torch.nn.functional.embedding
        out = f(ids, w, 1)
        if name == "ours":
            assert torch.equal(out, torch.nn.functional.embedding(ids, w, 1))
        (out * up.to(dt)).sum().backward()
        grads[name] = w.grad
    assert calls == [1], "the one-pass embedding gradient did not run"
    assert_within("dW", grads["ours"], grads["f64"], grads["torch"])
    with torch.no_grad():
        assert embedding(ids, w0, None).grad_fn is None


def test_weight_grad_launch_shapes_agree(device):
    """Pass B's tile (rows x columns a program, warps) and its sparse form change no bit:
    each element sums its runs in the same order (scripts/tied_grad_time.py --sweep relies
    on it)."""
    V, D, T = (90, 40, 150) if not ON_GPU else (32000, 2048, 16384)
    dw32 = torch.randn(V, D, device=device)
    g = torch.randn(T, D, device=device).to(torch.float16)
    ids = _ids(V, T, 2, "skewed", device)
    scale = torch.tensor(0.3, device=device)
    want = tied_weight_grad(dw32, scale, g, ids, 2, torch.float16)
    alone = embedding_weight_grad(g, ids, 2, V, torch.float16)
    assert torch.equal(embedding_weight_grad(g, ids, 2, V, torch.float16, sparse=True), alone)
    for launch in ((4, 16, 2), (32, 64, 4)) if not ON_GPU else ((4, 128, 2), (32, 512, 8)):
        assert torch.equal(tied_weight_grad(dw32, scale, g, ids, 2, torch.float16, launch), want), launch
        assert torch.equal(embedding_weight_grad(g, ids, 2, V, torch.float16, launch), alone), launch
        slots = (min(launch[0], 16),) + launch[1:]  # (the sparse form's most, below)
        sparse = embedding_weight_grad(g, ids, 2, V, torch.float16, slots, sparse=True)
        assert torch.equal(sparse, alone), slots
    with pytest.raises(ValueError, match="at most 16 slots"):
        embedding_weight_grad(g, ids, 2, V, torch.float16, (32, 64, 4), sparse=True)


@pytest.mark.gpu  # (the interpreter runs programs one by one: nothing to race there)
def test_weight_grad_is_deterministic(device):
    V, D, T = 128256, 2048, 16384
    dw32 = torch.randn(V, D, device=device)
    g = torch.randn(T, D, device=device).to(torch.float16)
    ids = _ids(V, T, None, "skewed", device)
    scale = torch.tensor(1.0, device=device)
    first = tied_weight_grad(dw32, scale, g, ids, None, torch.float16)
    assert torch.equal(first, tied_weight_grad(dw32, scale, g, ids, None, torch.float16))
    alone = embedding_weight_grad(g, ids, None, V, torch.float16)
    assert torch.equal(alone, embedding_weight_grad(g, ids, None, V, torch.float16))
    assert torch.equal(alone, embedding_weight_grad(g, ids, None, V, torch.float16, sparse=True))


def _tied_step(x, w, ids, t, dtype, tie, r=None):
    """h = the lookup of ids; the loss over (x + h) through the head w (its rows scaled by
    ``r``, the final norm's rstd, where given): w's gradient has both terms, formed through
    a TiedLink."""
    link = TiedLink()
    h = tied_embedding(ids, w, None, link)
    return linear_cross_entropy((x + h).to(dtype), w, t, tied=link, row_scale=r)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_scale"])
def test_tied_loss_gradients_match(scaled, dtype, device, monkeypatch):
    V, d, T = (100, 32, 48) if not ON_GPU else (32000, 2048, 4096)
    calls = []
    real = tied_mod.tied_weight_grad
    monkeypatch.setattr(tied_mod, "tied_weight_grad", lambda *a: calls.append(1) or real(*a))
    x0 = torch.randn(T, d, device=device)
    w0 = torch.randn(V, d, device=device) * 0.5
    ids = torch.randint(0, V, (T,), device=device)
    t = torch.randint(0, V, (T,), device=device)
    t[:5] = -100
    r0 = torch.rand(T, device=device) + 0.5 if scaled else None
    grads = {}
    for name, dt, tie in (("ours", dtype, True), ("torch", dtype, False), ("f64", torch.float64, False)):
        x = x0.to(dt).clone().requires_grad_()
        w = w0.to(dt).clone().requires_grad_()
        if tie:
            loss = _tied_step(x, w, ids, t, dt, tie, r0)
        else:  # PyTorch itself: the float64 reference, and its own error in the same dtype
            rows = x + torch.nn.functional.embedding(ids, w)
            if scaled:  # (PyTorch's own: the scaled rows rounded to the dtype)
                up = torch.float64 if dt == torch.float64 else torch.float32
                rows = (rows.to(up) * r0.to(up)[:, None]).to(dt)
            loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(rows, w), t)
        (loss * 1.7).backward()  # an incoming gradient other than 1
        grads[name] = (w.grad, x.grad)
    assert calls == [1], "the tied pass did not run"
    assert_within("dW", grads["ours"][0], grads["f64"][0], grads["torch"][0])
    assert_within("dx", grads["ours"][1], grads["f64"][1], grads["torch"][1])


# the GEMMs' dtype where a test needs one (fp32 GEMMs run on a CPU only)
GEMM_DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def test_lookup_off_the_loss_path(device):
    """The lookup's output does not reach the loss: the loss returns its own gradient (the
    engine will not run the lookup's backward in that pass: bit-equal to no link at all);
    a later backward through the lookup alone gets the lookup's gradient alone (the one
    pass without the head's term), within twice PyTorch's error."""
    V, d, T = 64, 16, 20
    w0 = torch.randn(V, d, device=device).to(GEMM_DTYPE)
    x = torch.randn(T, d, device=device).to(GEMM_DTYPE)
    ids = torch.randint(0, V, (T,), device=device)
    t = torch.randint(0, V, (T,), device=device)
    w, v = (w0.clone().requires_grad_() for _ in range(2))
    link = TiedLink()
    h = tied_embedding(ids, w, None, link)
    linear_cross_entropy(x, w, t, tied=link).backward()
    linear_cross_entropy(x, v, t).backward()
    assert torch.equal(w.grad, v.grad)
    w.grad = v.grad = None
    (h * 2).sum().backward()
    (torch.nn.functional.embedding(ids, v) * 2).sum().backward()
    u = w0.double().requires_grad_()
    (torch.nn.functional.embedding(ids, u) * 2).sum().backward()
    assert_within("dW", w.grad, u.grad, v.grad)


def test_two_losses_one_lookup(device):
    """Two losses over one lookup (two hand-overs: their scaled sum in one pass)."""
    V, d, T = 64, 16, 24
    w0 = torch.randn(V, d, device=device)
    x0 = torch.randn(T, d, device=device)
    ids = torch.randint(0, V, (T,), device=device)
    t1, t2 = (torch.randint(0, V, (T,), device=device) for _ in range(2))
    grads = {}
    for name, dt in (("ours", GEMM_DTYPE), ("torch", GEMM_DTYPE), ("f64", torch.float64)):
        w = w0.to(dt).clone().requires_grad_()
        if name == "ours":
            link = TiedLink()
            h = x0.to(dt) + tied_embedding(ids, w, None, link)
            loss = linear_cross_entropy(h, w, t1, tied=link) + 3 * linear_cross_entropy(h, w, t2, tied=link)
        else:
            h = x0.to(dt) + torch.nn.functional.embedding(ids, w)
            logits = h @ w.t()
            ce = torch.nn.functional.cross_entropy
            loss = ce(logits, t1) + 3 * ce(logits, t2)
        loss.backward()
        grads[name] = w.grad
    assert_within("dW", grads["ours"], grads["f64"], grads["torch"])


def test_bad_arguments(device):
    w = torch.randn(10, 8, device=device).to(GEMM_DTYPE).requires_grad_()
    ids = torch.randint(0, 10, (4,), device=device)
    with pytest.raises(TypeError, match="TiedLink"):
        linear_cross_entropy(torch.randn(4, 8, device=device).to(GEMM_DTYPE), w, ids, tied=object())
    with pytest.raises(ValueError, match="padding_idx"):
        tied_embedding(ids, w, 10, TiedLink())
    # a link bound to one weight's lookup, then a loss over another (its gradient would
    # reach the first): refused, casts of two weights too (a cast dies before the loss
    # runs: the check follows it to its leaf); the same weight passes, and two casts of it
    x = torch.randn(4, 8, device=device).to(GEMM_DTYPE)
    other = w.detach().clone().requires_grad_()
    p1, p2 = (v.detach().float().requires_grad_() for v in (w, other))
    for emb_w, loss_w in ((w, other), (p1.to(GEMM_DTYPE), p2.to(GEMM_DTYPE))):
        link = TiedLink()
        tied_embedding(ids, emb_w, None, link)
        with pytest.raises(ValueError, match="another weight"):
            linear_cross_entropy(x, loss_w, ids, tied=link)
    for emb_w, loss_w in ((lambda: w, lambda: w), (lambda: p1.to(GEMM_DTYPE), lambda: p1.to(GEMM_DTYPE))):
        link, kept = TiedLink(), emb_w()
        tied_embedding(ids, kept, None, link)
        linear_cross_entropy(x, loss_w(), ids, tied=link)  # (no error)
    with pytest.raises(TypeError, match="ids"):
        tied_embedding(ids.float(), w, None, TiedLink())
    with pytest.raises(TypeError, match="TiedLink"):
        tied_embedding(ids, w, None, None)
    with pytest.raises(ValueError, match="padding_idx"):
        embedding(ids, w, -11)  # (-1 counts from the end, as F.embedding's: test_api_edges)
    with pytest.raises(TypeError, match="ids"):
        embedding(ids.float(), w)
    with pytest.raises(ValueError, match="disagree"):
        embedding_weight_grad(torch.randn(4, 8, device=device), ids[:3], None, 10, torch.float32)
