"""``codetta.precompile``: every kernel of a step compiled at once before its first run."""

import copy

import pytest
import torch

import codetta
from codetta.kernels import precompile as pc

transformers = pytest.importorskip("transformers")


def _patched_llama(device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=64, max_position_embeddings=256,
                                   attn_implementation="sdpa")  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.LlamaForCausalLM(cfg).to(device, dtype)
    codetta.apply_codetta(model)
    return model


def _step(model, ids):
    def run():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine does")
def test_precompile_on_cpu_compiles_nothing():
    """On a CPU there is nothing to compile: the step is not run and gradients stay as they were."""
    model = _patched_llama("cpu")
    ids = torch.randint(0, 512, (2, 16))
    calls = []
    assert codetta.precompile(lambda: calls.append(1), model) == 0
    assert calls == [] and all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="step must be a callable"):
        codetta.precompile(model(input_ids=ids, labels=ids).loss)
    assert not pc.active()


@pytest.mark.gpu
def test_precompile_then_step_compiles_nothing_and_matches(monkeypatch):
    """Inside ``precompile`` every compile is deferred to the pool, the backward's (run in
    PyTorch's autograd thread) included; after it the real step compiles no kernel
    (Triton's cache hook sees none), its loss and every gradient are bit-equal to the same
    model's step without it, and the precompile left no gradient and no changed random
    state behind."""
    from triton import knobs
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    deferred, original = [], JITFunction._do_compile

    def recording(self, *args, **kwargs):
        deferred.append(_async_compile.active_mode.get() is not None)
        return original(self, *args, **kwargs)

    ids = torch.randint(0, 512, (2, 256), device="cuda")
    model = _patched_llama("cuda")
    twin = copy.deepcopy(model)
    rng = torch.cuda.get_rng_state()
    monkeypatch.setattr(JITFunction, "_do_compile", recording)
    n = codetta.precompile(_step(model, ids), model)
    monkeypatch.setattr(JITFunction, "_do_compile", original)
    assert all(deferred), f"{deferred.count(False)} of {len(deferred)} compiles ran outside the pool"
    assert n >= 0 and not pc.active()
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    compiles = []
    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **k: compiles.append(k.get("fn")) and None
    try:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = before
    assert compiles == [], f"{len(compiles)} kernels compiled after precompile"
    ref = twin(input_ids=ids, labels=ids, use_cache=False).loss
    ref.backward()
    assert torch.equal(loss, ref)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.gpu
def test_precompile_refuses_a_step_that_changes_the_weights():
    """A step with an optimizer step in it would run on unwritten outputs: precompile
    refuses it before the parameters change, with or without the model."""
    model = _patched_llama("cuda")
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"ran SGD.step\(\)"):
        codetta.precompile(step, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"ran SGD.step\(\)"):
        codetta.precompile(step)  # (without a model to check: refused before the step changes them)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_no_optimizer_steps_inside_precompile():
    """The guard precompile runs its dry run under: an optimizer step raises before it
    changes a parameter; outside it, steps run as usual."""
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    for opt in (torch.optim.SGD([w], lr=0.5), torch.optim.AdamW([w], lr=0.5)):
        with pc.no_optimizer_steps(), pytest.raises(RuntimeError, match=f"ran {type(opt).__name__}.step"):
            opt.step()
        assert torch.equal(w.detach(), torch.ones(3))
    torch.optim.SGD([w], lr=0.5).step()
    assert torch.equal(w.detach(), torch.zeros(3))


def test_every_row_pass_launch_goes_through_precompile():
    """A kernel launched as ``kernel[grid](...)`` would run (not compile) inside precompile,
    on unwritten inputs, and compile one by one: every launch site outside the GEMM engines
    goes through ``precompile.launch``."""
    import pathlib
    import re

    root = pathlib.Path(codetta.__file__).parent
    direct = re.compile(r"\b\w+_kernel\[")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "direct.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if direct.search(line)]  # fmt: skip
    assert found == [], f"launch through precompile.launch: {found}"
