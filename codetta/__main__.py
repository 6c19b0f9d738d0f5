"""Command line of codetta.

python -m codetta          the benchmark on a GPU, the interpreter demo on a CPU
python -m codetta demo     the K1 program against float64, and a tiny Llama through the drop-in
python -m codetta bench    the benchmarks against cuBLAS, eager, torch.compile and Liger (GPU)
python -m codetta tune     tune the GEMMs of a model's training step on this GPU (--list: CPU)
python -m codetta train    train a Hugging Face Llama-family model (torchrun: FSDP2 or DDP), loss and tokens/s
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from codetta.bench.ce import CASES as CE_CASES


def _demo(args) -> int:
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # the kernels are decorated when codetta is imported (before this runs):
        # start again with the interpreter switched on
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "codetta", *sys.argv[1:]])
    from codetta.demo import main as demo_main

    return demo_main()


def _bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU; on a CPU run `python -m codetta demo`", file=sys.stderr)
        return 2
    from codetta.bench import harness

    harness.OPTIONS.tuned_ab = args.tuned_ab
    harness.OPTIONS.variants = tuple(args.variants) if args.variants else None
    if args.settle_ms < 0:
        print("--settle-ms must be >= 0", file=sys.stderr)
        return 2
    harness.OPTIONS.settle_ms = args.settle_ms
    if args.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    harness.OPTIONS.rounds = args.rounds
    if args.batch < 1:
        print("--batch must be >= 1", file=sys.stderr)
        return 2
    if args.tune_methods and not args.tuned_ab:
        print("--tune-methods needs --tuned-ab", file=sys.stderr)
        return 2
    harness.OPTIONS.tune_methods = tuple(args.tune_methods or ())

    # a run cut short by `timeout` (SIGTERM) still hands back the picks of its part in
    # progress: the signal becomes SystemExit, so the finally below copies the caches
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        _bench_parts(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
        harness.save_ab_caches(args.out)
    return 0


def _exit_on_term(signum, frame):
    raise SystemExit(128 + signum)


def _bench_parts(args) -> None:
    from codetta.bench import foundation, harness, residual_norm

    for part in args.parts:  # in the order given
        if part == "model":
            from codetta.bench import model

            variants = [v for v in args.variants or model.VARIANTS if v in model.ALL_VARIANTS]
            model.run(args.out, cases=args.models, variants=variants, step_kind=args.step, batch=args.batch,
                      amp=args.amp)  # fmt: skip
        elif part == "residual_norm":
            residual_norm.run(args.out, widths=args.widths, research=args.research)
        elif part == "mlp":
            from codetta.bench import mlp

            mlp.run(args.out, widths=args.widths)
        elif part == "qkv":
            from codetta.bench import qkv

            qkv.run(args.out, cases=tuple(args.qkv_cases))
        elif part == "ce":
            from codetta.bench import ce

            ce.run(args.out, cases=tuple(CE_CASES_BY_NAME[c] for c in args.ce_cases))
        else:
            foundation.run(args.out, parts=[part])
        harness.save_ab_caches(args.out)  # (after each part too: a run killed outright keeps them)


# the ce part's cases by name, TOKENSxDxV, in bench/ce.py's order (main() imports the bench anyway)
CE_CASES_BY_NAME = {"x".join(map(str, case)): case for case in CE_CASES}


# the operator parts' own variant names, beside the model part's (bench/model.py)
PART_VARIANTS = (
    "codetta-triton",
    "codetta-recompute-y",
    "codetta-keep-y",
    "codetta:low-memory",
    "codetta:dx-f32",
    "codetta:row-scale",
)


def main(argv=None) -> int:
    from codetta.bench import model as model_bench  # (its names; transformers is imported on use)

    p = argparse.ArgumentParser(
        prog="codetta", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("demo", help="K1 against fp64 and a tiny Llama through the drop-in (CPU or GPU)")
    b = sub.add_parser("bench", help="the foundation benchmark against cuBLAS and torch.compile (GPU)")
    b.add_argument("--out", default="results", help="folder for CSV/JSON/PNG results")
    b.add_argument(
        "--parts",
        nargs="+",
        default=["overhead", "plain", "k1", "backward", "residual_norm"],
        choices=["overhead", "plain", "k1", "backward", "residual_norm", "mlp", "qkv", "ce", "model"],
    )
    b.add_argument(
        "--models",
        nargs="+",
        default=list(model_bench.CASES),
        choices=list(model_bench.CASES),
        help="model part: which training steps (needs transformers; Liger if installed)",
    )
    b.add_argument(
        "--step",
        default="train",
        choices=list(model_bench.STEPS),
        help="model part: what a timed step is: forward, backward and an AdamW step (train), or "
        "forward and backward only (fwd-bwd; the rows are named '<case> fwd+bwd')",
    )
    b.add_argument(
        "--batch",
        type=int,
        default=model_bench.BATCH,
        help=f"model part: sequences of {model_bench.SEQ} tokens per step (default "
        f"{model_bench.BATCH}; 1: a step of {model_bench.SEQ} tokens, where short GEMMs and the "
        "host's time per launch weigh most); rows at another batch are named '<case> @<tokens>'",
    )
    b.add_argument(
        "--amp",
        action="store_true",
        help="model part: float32 parameters, each forward under torch.autocast to bfloat16 (Hugging "
        "Face Trainer's bf16=True; codetta under CODETTA_AUTOCAST=cast); rows named '<case> amp'",
    )
    b.add_argument(
        "--variants",
        nargs="+",
        choices=[*model_bench.ALL_VARIANTS, *PART_VARIANTS],
        help="which variants to time (default: all of a part's; the floor / cuBLAS baseline is always "
        "timed, and codetta with --tuned-ab). Model part: torch.compile:regional and "
        "codetta+compile:regional compile each decoder layer and the loss apart, not the whole model "
        "(the causal mask stays on SDPA's is_causal path); codetta:<how> runs codetta with the portable "
        "mainloop only (no-pingpong), ping-pong only where it pays (epilogue-bound) or q, k, v and their "
        "dW in one launch each (qkv-one-launch), y formed again in the MLP's backward (recompute-y) "
        "or kept (keep-y; by default auto: formed again from model width 4096 up) or "
        "dg, du not written over g, u (no-overwrite) or a tied embedding's two gradients formed "
        "apart (no-tied-grad) or an untied embedding's backward left to PyTorch (no-embed-grad) or every "
        "launch through Triton's own path (no-direct) or the loss's dX kept in float32 to the "
        "backward's scale (ce-dx-f32) or y kept and the loss's chunks at 2 GiB together (more-memory); "
        "the operator parts call the portable-only variant codetta-triton and also offer "
        "codetta-recompute-y and codetta-keep-y (mlp) and codetta:low-memory, codetta:dx-f32, "
        "codetta:row-scale (ce; and its codetta:ce-chunk-2g and codetta:ce-probs, as the model part's; "
        "the model part also has codetta:ce-chunk-4g, its rows in one chunk at 16384 tokens). "
        "A name a part "
        "lacks is skipped there",
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
    b.add_argument(
        "--qkv-cases",
        nargs="+",
        default=["1B", "8B", "qwen3-8B"],
        choices=["1B", "8B", "qwen3-8B", "1B-pairs", "8B-pairs"],
        help="qkv part: which cases (the *-pairs ones rotate in the interleaved-pairs convention, "
        "RoPE(interleaved=True))",
    )
    b.add_argument(
        "--ce-cases",
        nargs="+",
        default=list(CE_CASES_BY_NAME),
        choices=list(CE_CASES_BY_NAME),
        help="ce part: which cases, as tokens x model width x vocabulary",
    )
    b.add_argument(
        "--settle-ms",
        type=float,
        default=120.0,
        help="sustained timing: ms of each variant's own calls, untimed, before each of its blocks "
        "(a block otherwise starts in the clock state the previous variant left; 0: no settling)",
    )
    b.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat each case's whole paired + sustained timing this many times: the tables "
        "report each method's median, the JSON keeps every round, and the model part prints "
        "each variant's spread over the rounds",
    )
    b.add_argument(
        "--tuned-ab",
        action="store_true",
        help="beside codetta, time codetta:shipped (the shipped table alone) and codetta:tuned (every "
        "shape tuned here on its first call, CODETTA_TUNE_SECONDS each, timed as CODETTA_TUNE_METHOD "
        "says) in every table, and print shipped / tuned per case",
    )
    b.add_argument(
        "--tune-methods",
        nargs="+",
        choices=[m + tail for m in ("paired", "sustained", "both") for tail in ("", "+tail")],
        help="with --tuned-ab: one tuned variant per method (codetta:tuned-paired, ...), each tuning "
        "into a cache of its own, instead of one codetta:tuned; METHOD+tail: with CODETTA_TAIL_LAUNCH=1",
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
    t.add_argument("--program", nargs="+", metavar="NAME",
                   help="only the keys of these programs (e.g. rms_qknorm_rope_128 after a change of its "
                        "candidates; with --pending, the list then names only their keys)")  # fmt: skip
    t.add_argument("--rope-interleaved", action="store_true",
                   help="the models' RoPE in the interleaved-pairs convention (Meta's original Llama "
                        "code, torchtitan; codetta.ops.RoPE(interleaved=True)) instead of Hugging Face's "
                        "rotate-half: the q and k projections then run the *_pairs_* programs")  # fmt: skip
    t.add_argument("--shorter-than", type=float, metavar="US",
                   help="only the keys whose GEMM takes less than US microseconds at a nominal 650 TFLOP/s "
                        "(short GEMMs: those an older tuner timed at the host's pace)")  # fmt: skip
    t.add_argument("--list", action="store_true", help="print the tuning keys and stop (no GPU needed)")
    t.add_argument("--gpu", metavar="NAME",
                   help="with --list: where each key's configuration comes from on this GPU (a name of a "
                        "shipped table's, e.g. 'NVIDIA H100 80GB HBM3'): its own table, another GPU's "
                        "(lent), or neither (the nearest entry or the rule)")  # fmt: skip
    t.add_argument("--force", action="store_true", help="tune even what the cache or shipped table knows")
    t.add_argument("--out", help="write a table in the shipped format (a folder: named after the GPU)")
    t.add_argument("--merge", action="store_true", help="keep the entries --out already holds")
    t.add_argument(
        "--pending", action="store_true",
        help="rewrite the pending list of the --out table file (keys asked for, not tuned) and stop (no GPU)",
    )  # fmt: skip
    t.add_argument("--seconds", type=float, default=1.0, help="paired timing per shape (default 1.0)")
    t.add_argument("--time-limit", type=float, metavar="S",
                   help="stop before a key whose tuning would end past S seconds (estimated from the "
                   "keys tuned so far), write the table and name the keys not reached")  # fmt: skip
    t.add_argument("--method", choices=("paired", "sustained", "both"), default=None,
                   help="how candidates are timed (default CODETTA_TUNE_METHOD, else paired): "
                        "paired, call by call; sustained, each in settled blocks of its own "
                        "(~0.5 s a candidate); both, the least worse ratio of the two")  # fmt: skip
    r = sub.add_parser("train", help="train a model for some steps: FSDP2/DDP under torchrun, codetta on/off")
    from codetta.train import add_arguments

    add_arguments(r)
    args = p.parse_args(argv)
    if args.cmd == "train":
        from codetta.train import train

        train(args)
        return 0
    if args.cmd == "tune":
        from codetta.tune import main as tune_main

        try:
            return tune_main(args)
        except ValueError as exc:  # a model name or config it cannot read: say so, no traceback
            p.error(f"tune: {exc}")
    if args.cmd is None:  # the main job: the benchmark on a GPU, the interpreter demo on a CPU
        import torch

        args = p.parse_args(["bench" if torch.cuda.is_available() else "demo"])
    return {"demo": _demo, "bench": _bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
