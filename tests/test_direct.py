"""The direct launch paths (kernels/direct.py) against Triton's own, with fake kernels and a
fake driver: the arguments that reach the C launcher must be the ones Triton's path hands it,
and a launch whose specialization may differ must take Triton's path (CPU; the GPU tests run
the real kernels through them on every repeated call)."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
from triton.backends.nvidia.driver import wrap_handle_tensordesc
from util import rand as _rand

from codetta.kernels import direct
from codetta.kernels.descriptors import tma_desc
from codetta.kernels.settings import override


def rand(*shape):
    return _rand(*shape, dtype=torch.float32, device="cpu")


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default
        self.has_default = default is not inspect.Parameter.empty


class _Compiled:
    """A compiled kernel whose launcher records what it is handed."""

    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, "fn", ("meta",)

    def _init_handles(self):
        pass


class _FakeJit:
    """``kernel[grid](*args, **kwargs)`` as Triton's JIT launches it: every parameter in
    order (defaults filled in) after the 9 launch arguments; counts its full launches."""

    def __init__(self, names, defaults):
        self.params = [_Param(n, defaults.get(n, inspect.Parameter.empty)) for n in names]
        self.arg_names, self.__name__ = names, "fake_kernel"
        self.calls, self.full = [], 0
        self.compiled = _Compiled(lambda *a: self.calls.append(a))

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.full += 1
            values = list(args)
            for p in self.params[len(args) :]:
                values.append(kwargs[p.name] if p.name in kwargs else p.default)
            g = (*grid, 1, 1)
            self.compiled.run(g[0], g[1], g[2], 7, "fn", ("meta",), None, None, None, *values)
            return self.compiled

        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 7, raising=False)
    direct._JIT.clear()
    yield
    direct._JIT.clear()


def test_launch_jit_binds_a_seen_signature(fake_cuda):
    """The second launch of a signature skips the JIT and hands the launcher what the JIT
    would; a different dtype, alignment, integer value or keyword misses."""
    fn = _FakeJit(["x", "out", "n", "eps", "BLOCK", "FLAG"], {"FLAG": True})
    x, out = rand(64), torch.empty(64)
    args = (x, out, 64, 1e-6)
    direct.launch_jit(fn, (4,), args, {"BLOCK": 128})
    direct.launch_jit(fn, (4,), args, {"BLOCK": 128})
    assert fn.full == 1 and len(fn.calls) == 2
    assert fn.calls[0] == fn.calls[1]  # (the same tensors: equal by identity)
    assert fn.calls[1][9:] == (x, out, 64, 1e-6, 128, True)
    x2 = rand(64)  # other data, same signature: bound, its own pointer passed
    direct.launch_jit(fn, (4,), (x2, out, 64, 1e-6), {"BLOCK": 128})
    assert fn.full == 1 and fn.calls[-1][9] is x2
    misses = [
        ((x.half(), out, 64, 1e-6), {"BLOCK": 128}, (4,)),  # dtype
        ((torch.empty(65)[1:], out, 64, 1e-6), {"BLOCK": 128}, (4,)),  # alignment
        ((x, out, 48, 1e-6), {"BLOCK": 128}, (4,)),  # an integer's value
        ((x, out, 64, 1e-6), {"BLOCK": 64}, (4,)),  # a constexpr
        ((x, out, 64, 1e-6), {"BLOCK": 128, "FLAG": False}, (4,)),  # a defaulted one given
        ((x, out, 64, 1e-6), {"BLOCK": 128}, (4, 2)),  # the grid
    ]
    for i, (a, kw, grid) in enumerate(misses, 2):
        direct.launch_jit(fn, grid, a, kw)
        assert fn.full == i, f"launch {i} should have missed"
    assert fn.calls[-1][:3] == (4, 2, 1)


def test_launch_jit_takes_the_full_path_for_hooks_and_unhashables(fake_cuda):
    from triton import knobs

    fn = _FakeJit(["x", "n", "T"], {})
    x = rand(8)
    for _ in range(2):
        direct.launch_jit(fn, (1,), (x, 8), {"T": [1, 2]})  # an unhashable argument
    assert fn.full == 2

    def hook(*_):
        pass

    t = rand(8)
    for _ in range(2):  # a tensor given by keyword: never bound (it would be fixed and kept alive)
        direct.launch_jit(fn, (1,), (x, 8), {"T": t})
    assert fn.full == 4 and not direct._JIT

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            direct.launch_jit(fn, (1,), (x, 8), {"T": 3})
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert fn.full == 6


class _FakeUtils:
    def __init__(self):
        self.encoded = 0

    def fill_tma_descriptor(self, ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        self.encoded += 1
        return (
            "map",
            ptr,
            swizzle,
            elem_size,
            elem_type,
            tuple(block),
            tuple(shape),
            tuple(strides),
            padding,
        )

    fill_tma_descriptor_tiled = fill_tma_descriptor  # (Triton 3.7's name, the same arguments)


class _FakeDriver:
    def __init__(self):
        self.utils = _FakeUtils()


class _Launcher:
    """Triton 3.6's CudaLauncher around a recording C launcher (its own descriptor wrapper)."""

    def __init__(self, signature, metas, calls):
        self.launch = wrap_handle_tensordesc(lambda *a: calls.append(a), signature, metas)
        self.global_scratch_size = self.profile_scratch_size = 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    *args)  # fmt: skip


def test_direct_kernel_encodes_each_descriptor_once(monkeypatch):
    """A bound kernel's descriptor arguments reach the C launcher as Triton's wrapper encodes
    them; encoded once per base address and layout, again for a new address or layout."""
    fake = _FakeDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", fake)
    signature = {"a": "tensordesc<fp16[64, 32]>", "M": "i32", "p": "*fp32", "b": "tensordesc<fp16[32, 32]>",
                 "C": "constexpr"}  # fmt: skip
    meta = lambda block: {"swizzle": 64, "elem_size": 2, "elem_type": 6, "block_size": block,  # noqa: E731
                          "fp4_padded": False}  # fmt: skip
    calls = []
    fn = _FakeJit(list(signature), {})
    if direct._RAW_LAYOUT:  # (the fake launcher is Triton 3.6's)
        compiled = _Compiled(_Launcher(signature, [meta([64, 32]), meta([32, 32])], calls))
        kernel = direct.DirectKernel(fn, compiled, 4, {"C": 5}, grid=3)
    a, b, p = rand(128, 64).half(), rand(96, 64).half(), torch.empty(8)
    da, db = tma_desc(a, [128, 64], [64, 1], [64, 32]), tma_desc(b, [96, 64], [64, 1], [32, 32])

    def triton_path(*args):
        compiled.run(3, 1, 1, 9, "fn", ("meta",), None, None, None, *args, 5)
        return calls.pop()

    if not direct._RAW_LAYOUT:  # (another Triton than 3.6: its launcher's own path, the same arguments)
        seen = []
        plain = direct.DirectKernel(fn, _Compiled(lambda *a: seen.append(a)), 4, {"C": 5}, grid=3)
        assert plain._raw is None
        plain(9, da, 128, p, db)
        assert seen == [(3, 1, 1, 9, "fn", ("meta",), None, None, None, da, 128, p, db, 5)]
        return
    assert kernel._raw is not None, "Triton's launcher no longer has the layout direct.py unwraps"

    def encodes(*args):  # the direct launch: descriptors encoded, what it handed on
        n = fake.utils.encoded
        kernel(9, *args)
        return fake.utils.encoded - n, calls.pop()

    assert encodes(da, 128, p, db) == (2, triton_path(da, 128, p, db))
    assert encodes(da, 128, p, db) == (0, triton_path(da, 128, p, db))
    a2 = rand(128, 64).half()  # another address
    da2 = tma_desc(a2, [128, 64], [64, 1], [64, 32])
    assert encodes(da2, 128, p, db) == (1, triton_path(da2, 128, p, db))
    wide = tma_desc(a2, [64, 128], [128, 1], [64, 32])  # the same address, another layout
    assert encodes(wide, 64, p, db) == (1, triton_path(wide, 64, p, db))
    fewer = tma_desc(a2, [32, 128], [128, 1], [64, 32])  # fewer rows, the same strides
    assert encodes(fewer, 64, p, db) == (1, triton_path(fewer, 64, p, db))
    assert encodes(da, 128, p, db) == (0, triton_path(da, 128, p, db))


def test_direct_launch_setting_reaches_row_launches(monkeypatch):
    """``CODETTA_DIRECT_LAUNCH=0``: every row launch through Triton's own path."""
    from codetta.kernels import precompile

    seen = []
    monkeypatch.setattr(direct, "launch_jit", lambda *a: seen.append(a))
    monkeypatch.setattr(precompile.device, "interpreting", lambda: False)
    fn = _FakeJit(["x"], {})
    precompile.launch(fn, (1,), rand(4))
    with override(direct_launch=False):
        precompile.launch(fn, (1,), rand(4))
    assert len(seen) == 1 and fn.full == 1


def test_row_passes_repeated_through_the_bound_path(device):
    """Row passes called again with the same signature and fresh data (on the GPU the
    second and third calls take ``launch_jit``'s bound path, the third at other addresses)
    match their float64 references each time; with the direct path off, too."""
    from codetta.programs.norm_rows import gamma_sumsq, rms_backward_rows
    from codetta.programs.rope import unrotate_half_rows

    torch.manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    M, D, hd = 200, 256, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    pos = torch.randint(0, 4096, (M,), device=device)
    before = len(direct._JIT)
    for direct_on in (True, True, True, False):
        x = _rand(M, D, dtype=dt, device=device)
        gamma = torch.rand(D, device=device, dtype=dt) + 0.5
        dh, dres = _rand(M, D, dtype=dt, device=device), _rand(M, D, dtype=dt, device=device)
        with override(direct_launch=direct_on):
            h, sumsq = gamma_sumsq(x, gamma)
            dx, n, parts = rms_backward_rows(dh, x, dres, sumsq, gamma, 1e-6)
            un = unrotate_half_rows(dh, pos, inv_freq, 1.0)
        x64, g64, dh64 = x.double(), gamma.double(), dh.double()
        s64 = x64.pow(2).sum(1)
        r = (s64 / D + 1e-6).rsqrt()[:, None]
        zeta = (dh64 * g64 * x64 * r).sum(1, keepdim=True)
        dx64 = r * (g64 * dh64 - x64 * r * zeta / D) + dres.double()
        ang = (pos.float()[:, None] * inv_freq).double()  # (float32 angles, as the pass forms them)
        c, s = ang.cos().repeat(1, 2 * D // hd), ang.sin().repeat(1, 2 * D // hd)
        g = dh64.view(M, D // hd, 2, hd // 2)
        swapped = torch.stack((g[:, :, 1], -g[:, :, 0]), 2).reshape(M, D)  # d1 = g1 c + g2 s, ...
        un64 = dh64 * c + swapped * s
        tol = 2e-2 if dt == torch.bfloat16 else 1e-5
        for name, got, want in (("h", h, x64 * g64), ("sumsq", sumsq, s64), ("dx", dx, dx64),
                                ("n", n, x64 * r * g64), ("dgamma", parts.sum(0), (dh64 * x64 * r).sum(0)),
                                ("unrotate", un, un64)):  # fmt: skip
            scale = want.abs().max().item()
            assert (got.double() - want).abs().max().item() <= tol * scale, f"{name}, direct={direct_on}"
    if device == "cuda":  # the three kernels bound once, by their first call
        assert len(direct._JIT) - before == 3


def test_made_outside_pools_runs_in_a_helper_thread(monkeypatch):
    """kernels/persistent.py: a kept CUDA buffer is made in another thread (CUDA graph trees
    route only the warming thread's allocations to their pool), after the helper's stream
    waits for the caller's, finished before it returns; its error is raised in the caller
    (fake CUDA streams: the CPU build has none)."""
    import threading

    from codetta.kernels import persistent

    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append((self.name, "waits", ev.on))

        def synchronize(self):
            log.append((self.name, "synchronized"))

    class Event:
        def record(self, stream):
            self.on = stream.name

    class Device:
        def __init__(self, dev):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    main = threading.get_ident()

    def current_stream(dev=None):
        return Stream("caller" if threading.get_ident() == main else "helper")

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "device", Device)
    where = []

    def make():
        where.append(threading.get_ident())
        log.append(("helper", "makes"))
        return torch.zeros(3)

    out = persistent.made_outside_pools(make, torch.device("cuda", 0))
    assert torch.equal(out, torch.zeros(3)) and where and where[0] != main
    assert log == [("helper", "waits", "caller"), ("helper", "makes"), ("helper", "synchronized")]

    def fails():
        raise ValueError("out of memory, say")

    with pytest.raises(ValueError, match="out of memory"):
        persistent.made_outside_pools(fails, torch.device("cuda", 0))
    assert persistent.made_outside_pools(lambda: 5, torch.device("cpu")) == 5  # CPU: in line
