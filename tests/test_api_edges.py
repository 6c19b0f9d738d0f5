"""The operators' public API at its edges (an audit's finds, NOTES.md): a gradient that
reaches the loss's returned log-sum-exp, a backward with create_graph=True, a caller's
in-place change before the first backward, the q/k/v module cast to half precision,
SwiGLUMLP over Hugging Face's own MLP, a rotary table whose source got a new ``.data``.
Each either works or says what is not supported; none is silently wrong."""

import copy

import pytest
import torch
from conftest import ON_GPU
from util import assert_within, rand, recording_backend

from codetta.nn import LinearCrossEntropyLoss, RMSNormQKVRoPE, SwiGLUMLP
from codetta.ops import RoPE, linear_cross_entropy, rmsnorm_linear, swiglu_mlp

DT = torch.float16 if ON_GPU else torch.float32


def _loss_inputs(device):
    x = rand(16, 32, dtype=DT, device=device).requires_grad_()
    w = rand(40, 32, dtype=DT, device=device, scale=0.2).requires_grad_()
    return x, w, torch.randint(0, 40, (16,), device=device)


def _mlp_leaves(device):
    shapes = ((8, 32, 1.0), (48, 32, 0.2), (48, 32, 0.2), (32, 48, 0.2))
    return [rand(*s[:2], dtype=DT, device=device, scale=s[2]).requires_grad_() for s in shapes]


def test_gradient_reaching_the_returned_lse_raises(device):
    """return_lse's lse carries no gradient of its own: a loss that uses it (a hand-made
    z-loss) raises instead of leaving its term out of the gradients."""
    x, w, t = _loss_inputs(device)
    loss, lse = linear_cross_entropy(x, w, t, return_lse=True)
    with pytest.raises(RuntimeError, match="a gradient reached the returned lse"):
        (loss + 0.1 * lse.pow(2).mean()).backward()
    x, w, t = _loss_inputs(device)
    loss, lse = linear_cross_entropy(x, w, t, return_lse=True)
    (loss + 0.1 * lse.detach().pow(2).mean()).backward()  # (a reported lse: fine)
    assert x.grad is not None and w.grad is not None


def test_returned_lse_across_a_graph_break(device, monkeypatch):
    """A compiled graph that ends between the loss and a use of its lse: AOTAutograd gives
    lse a tangent (zeros where the use carries no gradient), which the backward refused
    ("a gradient reached the returned lse") though eager mode ran. Zeros now pass, with
    eager mode's gradients, the check compiled with the graph (with torch 2.11's way of
    tracing a backward too, where a host read failed the graph's compile); a real gradient
    still raises (on the CPU: on a GPU the compiled refusal is a device assertion, which
    ends the process)."""
    x0, w0, t = _loss_inputs(device)

    def step(penalty):
        x, w = x0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
        loss, lse = linear_cross_entropy(x, w, t, return_lse=True)
        torch._dynamo.graph_break()
        (loss + penalty * lse.float().pow(2).mean()).backward()
        return x.grad, w.grad

    want = step(0.0)  # (eager: the product with 0.0 sends lse zeros, which pass)
    backend, compiled = recording_backend(monkeypatch, ON_GPU)
    torch._dynamo.reset()
    for a, b in zip(torch.compile(step, backend=backend)(0.0), want):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)
    assert "codetta.linear_cross_entropy.default" in compiled, compiled
    torch._dynamo.reset()
    if device == "cpu":
        with pytest.raises(RuntimeError, match="a gradient reached the returned lse"):
            torch.compile(step, backend=backend)(0.1)
        torch._dynamo.reset()


def test_double_backward_raises(device):
    """A gradient penalty (create_graph=True) through the operators raises by name: none has
    a double backward (before, the loss's gradient came back unconnected and the penalty
    added nothing, in silence)."""
    x, w, t = _loss_inputs(device)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(linear_cross_entropy(x, w, t) * 1.5, x, create_graph=True)
    leaves = _mlp_leaves(device)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(swiglu_mlp(*leaves).sum(), leaves[0], create_graph=True)


def test_callers_inplace_change_keeps_autograds_message(device):
    """A weight changed in place between the forward and the first backward: autograd's own
    error (it names the tensor), not the second-backward advice meant for retain_graph."""
    leaves = _mlp_leaves(device)
    out = swiglu_mlp(*leaves)
    with torch.no_grad():
        leaves[3].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        out.sum().backward()
    assert "CODETTA_OVERWRITE_SAVED" not in str(info.value)


def test_qkv_module_keeps_float32_frequencies_when_cast(device):
    """RMSNormQKVRoPE.half() / .to(dtype) casts the weights and keeps inv_freq float32 at its
    own precision (it crashed on a float16 inv_freq); the rotation is the float32 module's."""
    torch.manual_seed(0)
    mod = RMSNormQKVRoPE(64, 4, 2, 16, device=device)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = rand(2, 5, 64, dtype=torch.float16, device=device)
    # (the float32 module's rotation on the CPU: the GPU serves no float32 GEMM)
    want = [t.half().to(device) for t in copy.deepcopy(mod).float().cpu()(x.float().cpu())]
    inv = mod.inv_freq.clone()
    half = mod.half()
    assert half.inv_freq.dtype == torch.float32 and torch.equal(half.inv_freq, inv)
    if not ON_GPU:
        return  # (float16 GEMMs through the interpreter: slow; the GPU runs the cast module)
    for got, ref in zip(half(x), want):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_modules_made_on_the_meta_device():
    """Made on the meta device then ``to_empty``: RMSNormQKVRoPE's frequencies (a buffer
    outside the state_dict, which load_state_dict does not fill) are made again, from
    rope_theta or from the inv_freq given (they were left as whatever memory held), and
    ResidualRMSNormLinear has ``reset_parameters`` (it had none: its weights stayed empty)."""
    from codetta.nn import ResidualRMSNormLinear

    given = torch.rand(8) * 0.5
    for kw in ({"rope_theta": 500000.0}, {"inv_freq": given}):
        want = RMSNormQKVRoPE(64, 4, 2, 16, **kw)
        with torch.device("meta"):
            made = RMSNormQKVRoPE(64, 4, 2, 16, **kw)
        made = made.to_empty(device="cpu")
        made.load_state_dict(want.state_dict())
        assert torch.equal(made.inv_freq, want.inv_freq)
        assert torch.equal(made.half().inv_freq, want.inv_freq)  # (and kept float32 after)
    with pytest.raises(ValueError, match="inv_freq is on the meta device"):
        RMSNormQKVRoPE(64, 4, 2, 16, inv_freq=given.to("meta"))
    with torch.device("meta"):
        lin = ResidualRMSNormLinear(32, 64, 48)
    lin = lin.to_empty(device="cpu")
    with torch.no_grad():
        lin.proj.fill_(float("nan")), lin.norm_weight.fill_(float("nan")), lin.weight.fill_(float("nan"))
    lin.reset_parameters()
    assert torch.equal(lin.norm_weight, torch.ones(64))
    for w in (lin.proj, lin.weight):
        bound = w.shape[1] ** -0.5  # (nn.Linear's: kaiming_uniform_ with a = sqrt(5))
        assert torch.isfinite(w).all() and w.abs().max() <= bound and w.std() > bound / 4


def test_swiglu_module_from_hugging_faces_mlp():
    """SwiGLUMLP.from_mlp takes a stock LlamaMLP (its act_fn is transformers' SiLUActivation,
    not nn.SiLU) and shares its weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    mlp = LlamaMLP(cfg)
    mod = SwiGLUMLP.from_mlp(mlp)
    assert mod.gate_proj is mlp.gate_proj and mod.down_proj is mlp.down_proj
    cfg.hidden_act = "gelu"
    with pytest.raises(ValueError, match="SwiGLUMLP computes silu"):
        SwiGLUMLP.from_mlp(LlamaMLP(cfg))


def test_rotary_table_follows_a_new_data(device):
    """The RoPE tables kept with an inv_freq tensor are remade when it gets a new ``.data``
    (same tensor object, version counter unchanged, another storage)."""
    hd, d = 16, 32
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    x = rand(5, d, dtype=DT, device=device)
    g = torch.ones(d, device=device)
    ws = [rand(hd, d, dtype=DT, device=device, scale=0.2) for _ in range(2)]
    pos = torch.arange(5, device=device)
    rmsnorm_linear(x, g, ws, 1e-6, rope=RoPE(pos, inv))  # (tables made)
    inv.data = inv.data * 0.25
    q = rmsnorm_linear(x, g, ws, 1e-6, rope=RoPE(pos, inv))[0]
    fresh = rmsnorm_linear(x, g, ws, 1e-6, rope=RoPE(pos, inv.clone()))[0]
    assert torch.equal(q, fresh)


def test_layout_errors_name_the_callers_argument(device):
    """Layouts a GEMM cannot read (a strided weight, gate and up laid out differently, a
    strided gamma, data off a 16-byte boundary) are refused naming the caller's argument,
    not an internal operand, and a valid call before does not hide them (the remembered
    checks key on strides and alignment too)."""
    from codetta.ops import residual_rmsnorm_linear

    y, res = rand(8, 32, dtype=DT, device=device), rand(8, 32, dtype=DT, device=device)
    w_o, w = rand(32, 32, dtype=DT, device=device), rand(16, 32, dtype=DT, device=device)
    g = torch.rand(32, device=device) + 0.5
    residual_rmsnorm_linear(y, w_o, res, g, w, 1e-6)  # (remembered as valid)
    wide = rand(32, 64, dtype=DT, device=device)
    for args, why in (
        ((y, wide[:, ::2], res, g, w), "w_o must be contiguous or a transposed view"),
        ((y, w_o, res, torch.rand(64, device=device)[::2], w), "gamma must be contiguous"),
        ((rand(8 * 32 + 1, dtype=DT, device=device)[1:].view(8, 32), w_o, res, g, w), "y's data must start"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            residual_rmsnorm_linear(*args, 1e-6)
    x, wg, wu, wd = (t.detach() for t in _mlp_leaves(device))
    with pytest.raises(ValueError, match="w_gate, w_up must be laid out alike.*w_gate is a transposed view"):
        swiglu_mlp(x, wg.t().contiguous().t(), wu, wd)
    xl, wl, t = _loss_inputs(device)
    for bad in (rand(40, 64, dtype=DT, device=device)[:, ::2], rand(40, 64, dtype=DT, device=device)[:, 32:]):
        # (a column slice with unit stride but gaps between rows: named as such, not "unit stride")
        with pytest.raises(ValueError, match=r"linear_weight must be contiguous .*\(no gaps between"):
            linear_cross_entropy(xl.detach(), bad, t)


def test_negative_padding_idx_and_the_loss_modules_repr(device):
    """embedding's padding_idx counts from the end when negative, as F.embedding's does (the
    padded row gets no gradient); LinearCrossEntropyLoss's repr shows return_lse."""
    from codetta.ops import embedding

    w = rand(12, 16, dtype=DT, device=device).requires_grad_()
    ids = torch.tensor([[1, 11, 3, 11]], device=device)
    embedding(ids, w, padding_idx=-1).float().sum().backward()
    assert w.grad[11].abs().max() == 0 and w.grad[1].abs().max() > 0
    with pytest.raises(ValueError, match="padding_idx must be None or in"):
        embedding(ids, w, padding_idx=-13)
    assert "return_lse=True" in repr(LinearCrossEntropyLoss(return_lse=True))
    # its options are checked when it is made, not at its first forward
    for bad, why in ((dict(reduction="bogus"), "reduction"), (dict(label_smoothing=2.0), "label_smoothing"),
                     (dict(z_loss=-1.0), "z_loss"), (dict(softcap=0.0), "softcap"),
                     (dict(vocab_chunk=12), "vocab_chunk")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            LinearCrossEntropyLoss(**bad)


def test_class_weights_that_require_grad(device):
    """Class weights that require grad: refused where a gradient would be asked for (none
    is formed for them; PyTorch's cross-entropy refuses at the backward), taken under
    no_grad (an evaluation pass with learned class weights)."""
    x, w, t = _loss_inputs(device)
    cw = torch.rand(40, device=device).requires_grad_()
    with pytest.raises(RuntimeError, match="must not require grad"):
        linear_cross_entropy(x, w, t, weight=cw)
    with torch.no_grad():
        assert torch.isfinite(linear_cross_entropy(x, w, t, weight=cw))


def _norm_linear_inputs(device, M, dtype=DT):
    K, d = 32, 32
    y = rand(M, K, dtype=dtype, device=device)
    residual = rand(M, d, dtype=dtype, device=device)
    return y, residual


def test_compiled_norm_operators_follow_the_token_count(device):
    """Under torch.compile the norm operators' argument check runs in full (once per
    compile) instead of a lookup keyed on the shapes, which pinned the token count to a
    constant: one compile per count (the ninth an error under fullgraph) and
    mark_dynamic refused. eps traced as a symbolic float (dynamic=True) is served."""
    from codetta.ops import residual_rmsnorm_linear

    torch.manual_seed(0)
    K, d, N = 32, 32, 48
    w_o = rand(d, K, dtype=DT, device=device, scale=K**-0.5)
    gamma = torch.rand(d, device=device) + 0.5
    w = rand(N, d, dtype=DT, device=device, scale=d**-0.5)
    counts = (8, 16, 24, 40, 56, 72, 88, 104, 120, 136)  # (more than the recompile limit, 8)
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]
    before = frames["unique_graphs"]
    fn = torch.compile(
        lambda y, r, eps: residual_rmsnorm_linear(y, w_o, r, gamma, w, eps),
        backend="eager", fullgraph=True, dynamic=True,
    )  # fmt: skip
    for M in counts:
        y, residual = _norm_linear_inputs(device, M)
        got = fn(y, residual, 1e-5)
        want = residual_rmsnorm_linear(y, w_o, residual, gamma, w, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert frames["unique_graphs"] - before <= 2
    torch._dynamo.reset()
    y, residual = _norm_linear_inputs(device, 24)
    torch._dynamo.mark_dynamic(y, 0)
    torch._dynamo.mark_dynamic(residual, 0)
    fixed = torch.compile(lambda y, r: residual_rmsnorm_linear(y, w_o, r, gamma, w), backend="eager")
    assert torch.equal(fixed(y, residual)[1], residual_rmsnorm_linear(y, w_o, residual, gamma, w)[1])


def test_fake_outputs_match_the_real_ones_in_mixed_precision(device):
    """The operator's fake implementation (what torch.compile traces) gives every output
    the real one's dtype with a float32 residual stream over float16 weights (the empty
    w_gamma placeholder came out float32 under the fake one, float16 for real)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    d, N = 32, 48
    x = rand(8, d, dtype=torch.float32, device=device)  # (float32: the residual stream)
    gamma = torch.rand(d, device=device) + 0.5
    w = rand(N, d, dtype=torch.float16, device=device, scale=d**-0.5)
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "codetta":
                calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Record():
        rmsnorm_linear(x, gamma, w)
    ((op, args, kwargs),) = [c for c in calls if "backward" not in c[0].name()]
    real = op(*args, **kwargs)
    mode = FakeTensorMode()

    def fake_of(a):
        if isinstance(a, torch.Tensor):
            return mode.from_tensor(a)
        return [fake_of(t) for t in a] if isinstance(a, (list, tuple)) else a

    fake_args = [fake_of(a) for a in args]
    with mode:
        fake = op(*fake_args, **kwargs)

    def flat(o):
        return [t for v in o for t in (flat(v) if isinstance(v, (list, tuple)) else [v])]

    assert [(t.shape, t.dtype) for t in flat(real)] == [(t.shape, t.dtype) for t in flat(fake)]


def test_torch_func_is_refused_by_name(device):
    """torch.func's transforms over the operators raise naming the argument and the way
    out (a data-pointer error from inside the checks before)."""
    from codetta.ops import residual_rmsnorm_linear

    torch.manual_seed(0)
    K, d, N = 32, 32, 48
    w_o = rand(d, K, dtype=DT, device=device, scale=K**-0.5)
    gamma = torch.rand(d, device=device) + 0.5
    w = rand(N, d, dtype=DT, device=device, scale=d**-0.5)
    y, residual = _norm_linear_inputs(device, 8)

    def loss(weight):
        return residual_rmsnorm_linear(y, w_o, residual, gamma, weight)[1].float().sum()

    with pytest.raises(TypeError, match="weight is a torch.func transform's tensor .*torch.autograd"):
        torch.func.grad(loss)(w)
    x, wg, wu, wd = _mlp_leaves(device)
    with pytest.raises(TypeError, match="torch.func transform's tensor"):
        torch.func.vmap(lambda t: swiglu_mlp(t, wg, wu, wd))(x.detach()[None])
    import codetta

    with pytest.raises(TypeError, match="^a is a torch.func transform's tensor"):
        torch.func.vmap(lambda t: codetta.gemm(t, w))(y[None])


def test_rmsnorm_linear_names_x_for_its_device():
    """rmsnorm_linear's device errors name x (they named y, the general operator's
    argument, which its caller never passed)."""
    x, gamma, w = torch.randn(8, 32), torch.rand(32) + 0.5, torch.randn(48, 32)
    with pytest.raises(ValueError, match=r"^x: device meta is not supported"):
        rmsnorm_linear(x.to("meta"), gamma.to("meta"), w.to("meta"))
    with pytest.raises(ValueError, match=r"^weight\[1\] is on meta but x is on cpu"):
        rmsnorm_linear(x, gamma, [w, w.to("meta")])


def test_modules_under_autocast(device, monkeypatch):
    """A float32 model's modules under torch.autocast run their GEMMs in autocast's dtype,
    as nn.Linear's do (on the GPU a float32 GEMM was refused: "float32 GEMMs are not
    served"), the residual stream and the norms' weights as they are; the gradients
    reach the float32 parameters."""
    import torch.nn.functional as F

    from codetta.nn import ResidualRMSNormLinear

    torch.manual_seed(0)
    kind, dt = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float16)
    mlp = SwiGLUMLP(64, 96, device=device)
    x = rand(10, 64, dtype=torch.float32, device=device).requires_grad_()
    residual = rand(10, 64, dtype=torch.float32, device=device)
    ws = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]

    def chain(x, residual, wg, wu, wd):
        return residual + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    with torch.autocast(kind, dtype=dt):
        got = mlp(x, residual)
        bare = mlp(x)
        ref = chain(x, residual, *ws)  # (PyTorch under autocast: its error in the same dtype)
    leaves64 = [t.detach().double().cpu().requires_grad_() for t in (x, *ws)]
    ref64 = chain(leaves64[0], residual.double().cpu(), *leaves64[1:])
    assert got.dtype == ref.dtype == torch.float32 and bare.dtype == dt
    assert_within("out", got.double().cpu(), ref64, ref.double().cpu())
    assert_within("out without residual", bare.double().cpu(), ref64 - residual.double().cpu(),
                  (ref - residual).double().cpu())  # fmt: skip
    grads = torch.autograd.grad(got.sum(), [x, ws[0]])
    want = torch.autograd.grad(ref.sum(), [x, ws[0]])
    want64 = torch.autograd.grad(ref64.sum(), leaves64[:2])
    for name, g, w, w64 in zip(("dx", "dW_gate"), grads, want, want64):
        assert g.dtype == torch.float32
        assert_within(name, g.double().cpu(), w64, w.double().cpu())
    block = ResidualRMSNormLinear(32, 64, 48, eps=1e-5, device=device)
    y = rand(10, 32, dtype=torch.float32, device=device)
    with torch.no_grad():
        block.norm_weight.copy_(torch.rand(64, device=device) + 0.5)

    def block_chain(y, residual, proj, gamma, weight):
        x = residual + F.linear(y, proj)
        return x, F.linear(F.rms_norm(x, (64,), gamma, 1e-5), weight)

    with torch.autocast(kind, dtype=dt):
        xs, z = block(y, residual)
        x_ref, z_ref = block_chain(y, residual, block.proj, block.norm_weight, block.weight)
    assert (xs.dtype, z.dtype) == (torch.float32, dt) == (x_ref.dtype, z_ref.dtype)
    args64 = [t.detach().double().cpu() for t in (y, residual, block.proj, block.norm_weight, block.weight)]
    for name, got, ref, ref64 in zip(("x", "z"), (xs, z), (x_ref, z_ref), block_chain(*args64)):
        assert_within(name, got.double().cpu(), ref64, ref.double().cpu())
    qkv = RMSNormQKVRoPE(64, 4, 2, 16, device=device)
    h = rand(2, 5, 64, dtype=torch.float32, device=device)

    def qkv_chain(h, gamma, ws, inv):
        n = F.rms_norm(h, (64,), gamma, qkv.eps)
        outs = [F.linear(n, w).unflatten(-1, (-1, 16)).transpose(1, 2) for w in ws]
        angles = torch.arange(h.shape[1], dtype=inv.dtype, device=inv.device)[:, None] * inv
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(outs[0].dtype) for f in (torch.cos, torch.sin))

        def rotate(t):  # (rotate-half, in t's dtype, as the module's output is)
            return t * cos + torch.cat([-t[..., 8:], t[..., :8]], -1) * sin

        return rotate(outs[0]), rotate(outs[1]), outs[2]

    ws = [qkv.q_proj.weight, qkv.k_proj.weight, qkv.v_proj.weight]
    with torch.autocast(kind, dtype=dt):
        outs = qkv(h)
        refs = qkv_chain(h, qkv.norm.weight, ws, qkv.inv_freq)
    refs64 = qkv_chain(*(t.detach().double().cpu() for t in (h, qkv.norm.weight)),
                       [w.detach().double().cpu() for w in ws], qkv.inv_freq.double().cpu())  # fmt: skip
    for name, got, ref, ref64 in zip("qkv", outs, refs, refs64):
        assert got.dtype == dt
        assert_within(name, got.double().cpu(), ref64, ref.double().cpu())
    # the LM head's loss: its product in autocast's dtype, the loss in float32 (it once took the
    # float32 operands as given: a float32 loss on the CPU, refused on the GPU)
    head = rand(40, 64, dtype=torch.float32, device=device, scale=0.3).requires_grad_()
    n = rand(10, 64, dtype=torch.float32, device=device).requires_grad_()
    target = torch.randint(0, 40, (10,), device=device)
    import codetta.nn.cross_entropy as nn_ce

    seen = []
    inner = nn_ce.linear_cross_entropy
    monkeypatch.setattr(nn_ce, "linear_cross_entropy", lambda x, w, *a, **k: seen.append((x.dtype, w.dtype))
                        or inner(x, w, *a, **k))  # fmt: skip
    with torch.autocast(kind, dtype=dt):
        loss = LinearCrossEntropyLoss()(n, head, target)
        ref = F.cross_entropy(F.linear(n, head), target)
    assert seen == [(dt, dt)], f"the loss's GEMM operands were {seen}, not in autocast's {dt}"
    leaves64 = [t.detach().double().cpu().requires_grad_() for t in (n, head)]
    ref64 = F.cross_entropy(F.linear(*leaves64), target.cpu())
    assert loss.dtype == ref.dtype == torch.float32
    assert_within("loss", loss.double().cpu(), ref64, ref.double().cpu())
    grads = torch.autograd.grad(loss, [n, head])
    for name, g, w, w64 in zip(("dx", "dW_head"), grads, torch.autograd.grad(ref, [n, head]),
                               torch.autograd.grad(ref64, leaves64)):  # fmt: skip
        assert g.dtype == torch.float32
        assert_within(name, g.double().cpu(), w64, w.double().cpu())


def test_derived_tables_forget_at_shutdown(monkeypatch):
    """The weak reference's callback that drops a derived table keeps its own table and
    function (at interpreter exit a dying source's callback found the module's globals
    None: "Exception ignored in derived.<locals>.<lambda> ... _forget")."""
    from codetta.ops import _eager

    src = torch.arange(4.0)
    _eager.derived(src, "test", lambda: torch.zeros(2))
    table, key = _eager._DERIVED, next(k for k, v in _eager._DERIVED.items() if v[0]() is src)
    monkeypatch.setattr(_eager, "_DERIVED", None)
    monkeypatch.setattr(_eager, "_forget", None)
    del src
    import gc

    gc.collect()
    assert key not in table
