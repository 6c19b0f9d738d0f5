"""Error bounds relative to PyTorch's own error in the same dtype."""

import torch
from conftest import ON_GPU

# (M, N, K): odd M, N and K that are not tile multiples (tiles are 32 on CPU, 128+ on GPU)
SHAPES = (
    [(1, 64, 64), (77, 96, 40), (300, 72, 136), (200, 56, 72)]
    if not ON_GPU
    else [(1, 1024, 512), (77, 2048, 1024), (1000, 1536, 2056), (4096, 4096, 4096)]
)


def err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error against an fp64 reference; NaN anywhere counts as infinite."""
    x = x.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return (x - ref.double()).abs().max().item() if x.numel() else 0.0


def error_terms(ours: torch.Tensor, ref64: torch.Tensor, torch_same_dtype: torch.Tensor) -> tuple:
    """``assert_within``'s terms: (err(ours), err(PyTorch in the same dtype), one float32
    ulp of the largest reference value)."""
    return err(ours, ref64), err(torch_same_dtype, ref64), 2.0**-23 * ref64.abs().max().item()


def within_ratio(terms: tuple) -> float:
    """``error_terms`` as one ratio, error / (2 x PyTorch's + the ulp): <= 1 passes."""
    e_ours, e_torch, tiny = terms
    bound = 2 * e_torch + tiny
    return e_ours / bound if bound else (0.0 if e_ours == 0 else float("inf"))


def assert_terms(name: str, terms: tuple) -> None:
    """``error_terms`` within the bound: err(ours) <= 2 * err(PyTorch's) + the ulp."""
    e_ours, e_torch, tiny = terms
    assert e_ours <= 2 * e_torch + tiny, (
        f"{name}: error {e_ours:.3e} > 2 x torch's {e_torch:.3e} + {tiny:.1e}"
    )


def assert_within(name: str, ours: torch.Tensor, ref64: torch.Tensor, torch_same_dtype: torch.Tensor):
    """err(ours) <= 2 * err(PyTorch in the same dtype) + one float32 ulp of the largest
    reference value (for outputs PyTorch gets exactly). The term was 1e-6 of the largest
    value and at least 1e-6: ~8 float32 ulp, and far more for small gradients, so a float32
    check allowed ~10x PyTorch's error and hid a loss 11x past it (NOTES.md)."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    assert_terms(name, error_terms(ours, ref64, torch_same_dtype))


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32, device=device) * scale).to(dtype)


def check_compile_matches_eager(fn, leaves, on_gpu: bool):
    """``torch.compile(fn, fullgraph=True)`` (inductor on a GPU, aot_eager on a CPU) gives
    eager's output and the same gradients: the custom ops trace without graph breaks."""
    backend = "inductor" if on_gpu else "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    a = [t.detach().clone().requires_grad_() for t in leaves]
    b = [t.detach().clone().requires_grad_() for t in leaves]
    out_c, out_e = compiled(*a), fn(*b)
    out_c.backward()
    out_e.backward()
    assert torch.allclose(out_c, out_e, rtol=1e-3)
    for i, (ta, tb) in enumerate(zip(a, b)):
        diff = (ta.grad.double() - tb.grad.double()).abs().max().item()
        assert torch.equal(ta.grad, tb.grad), f"leaf {i}: compiled and eager gradients differ by {diff:.3e}"


def recording_backend(monkeypatch, on_gpu: bool):
    """A torch.compile backend (inductor on a GPU, aot_eager on a CPU) that records the
    calls of each graph once its compile succeeded (a graph whose compile fails is run
    uncompiled by Dynamo, with the right numbers: counting the operators in ``calls`` tells
    it apart), and the list it records into. AOTAutograd's trace of a backward is made to
    look as torch 2.11 makes it: not reported as compiling (torch 2.13 reports it; NOTES.md,
    run 68), so a check that asks only ``torch.compiler.is_compiling()`` fails here too."""
    import contextlib

    monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext, raising=False)
    calls = []

    def backend(gm, example_inputs):
        real = torch._dynamo.lookup_backend("inductor" if on_gpu else "aot_eager")(gm, example_inputs)
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return real

    return backend, calls


def load_script(name: str):
    """The module of ``scripts/<name>.py`` (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def transformers_4() -> bool:
    """The installed transformers is a 4.x release (the `hf` extra allows 4.53 on): its
    configs take RoPE settings in their 4.x fields, its training forward builds a mask."""
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5
