"""Command line of codetta.

python -m codetta          the benchmark on a GPU, the interpreter demo on a CPU
python -m codetta demo     run the K1 program once and check it against float64
python -m codetta bench    the benchmarks against cuBLAS, eager, torch.compile and Liger (GPU)
python -m codetta tune     tune the GEMMs of a model's training step on this GPU (--list: CPU)
"""

from __future__ import annotations

import argparse
import os
import sys


def _demo(args) -> int:
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # the kernels are decorated when codetta is imported (before this runs):
        # start again with the interpreter switched on
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "codetta", *sys.argv[1:]])
    import codetta
    from codetta import programs as pg
    from codetta import reference as ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    M, N, K = (4096, 4096, 4096) if device == "cuda" else (200, 96, 128)
    mode = (
        "GPU"
        if device == "cuda"
        else ("Triton interpreter" if codetta.interpreting() else "PyTorch reference")
    )
    print(
        f"codetta {codetta.__version__} demo: K1 program (residual + RMSNorm statistics) on {mode}, "
        f"M={M} N={N} K={K} {str(dtype).removeprefix('torch.')}"
    )
    torch.manual_seed(0)
    y = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) * K**-0.5).to(dtype)
    r = torch.randn(M, N, device=device).to(dtype)
    g = torch.rand(N, device=device) + 0.5
    out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=r, gamma=g)
    x64, h64, ss64 = ref.residual_rms_chain(y.double(), w.double(), r.double(), g.double())
    x_t = r + y @ w.t()
    ok = True
    for name, ours, want, theirs in [
        ("x", out.x, x64, x_t),
        ("h", out.h, h64, (x_t.float() * g).to(dtype)),
        ("sumsq", out.sumsq, ss64, x_t.float().pow(2).sum(-1)),
    ]:
        e_ours = (ours.double() - want).abs().max().item()
        e_torch = (theirs.double() - want).abs().max().item()
        good = e_ours <= 2 * e_torch + 1e-6 * want.abs().max().item()
        ok &= good
        print(
            f"  {name:<6} max error vs fp64: codetta {e_ours:.2e}, PyTorch {e_torch:.2e}  "
            + ("ok" if good else "FAIL")
        )
    print("demo passed" if ok else "demo FAILED")
    return 0 if ok else 1


def _bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU; on a CPU run `python -m codetta demo`", file=sys.stderr)
        return 2
    from codetta.bench import foundation, residual_norm

    for part in args.parts:  # in the order given
        if part == "residual_norm":
            residual_norm.run(args.out, widths=args.widths, research=args.research)
        else:
            foundation.run(args.out, parts=[part])
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="codetta", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("demo", help="run the K1 program once and check it against fp64 (CPU or GPU)")
    b = sub.add_parser("bench", help="the foundation benchmark against cuBLAS and torch.compile (GPU)")
    b.add_argument("--out", default="results", help="folder for CSV/JSON/PNG results")
    b.add_argument(
        "--parts",
        nargs="+",
        default=["overhead", "plain", "k1", "backward", "residual_norm"],
        choices=["overhead", "plain", "k1", "backward", "residual_norm"],
    )
    b.add_argument(
        "--widths",
        nargs="+",
        default=["1B", "8B"],
        choices=["1B", "8B"],
        help="model widths for the residual_norm part",
    )
    b.add_argument(
        "--research", action="store_true", help="residual_norm: also time the alternative backwards"
    )
    t = sub.add_parser("tune", help="tune every GEMM a model's training step runs through codetta (GPU)")
    t.add_argument(
        "--model", nargs="+", help="known names (llama3-8b, qwen3-4b, ...), config.json paths or hub names"
    )
    t.add_argument("--all-known", action="store_true", help="every model in codetta.models.KNOWN")
    t.add_argument("--widths", nargs=6, type=int, metavar=("D", "F", "HEADS", "KV", "HEAD_DIM", "VOCAB"),
                   help="explicit widths instead of a model config")  # fmt: skip
    t.add_argument("--tokens", nargs="+", type=int, default=[4096, 8192, 16384, 32768, 65536],
                   help="tokens per step (batch x sequence) to tune for")  # fmt: skip
    t.add_argument("--list", action="store_true", help="print the tuning keys and stop (no GPU needed)")
    t.add_argument("--force", action="store_true", help="tune even what the cache or shipped table knows")
    t.add_argument("--out", help="write a table in the shipped format (a folder: named after the GPU)")
    t.add_argument("--merge", action="store_true", help="keep the entries --out already holds")
    t.add_argument("--seconds", type=float, default=1.0, help="paired timing per shape (default 1.0)")
    args = p.parse_args(argv)
    if args.cmd == "tune":
        from codetta.tune import main as tune_main

        return tune_main(args)
    if args.cmd is None:  # the main job: the benchmark on a GPU, the interpreter demo on a CPU
        import torch

        args = p.parse_args(["bench" if torch.cuda.is_available() else "demo"])
    return {"demo": _demo, "bench": _bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
