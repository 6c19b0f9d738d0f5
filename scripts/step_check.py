"""Is the benchmark's codetta model step doing all its work? (GPU machine.)

Builds the model part's Llama-3.2-1B case (16384 tokens), then for eager, codetta and
codetta after ``codetta.precompile``: one forward+backward's loss and every gradient
against eager's (relative norm of the difference, the worst parameter), and the time of
5 forward+backward passes back to back. A kernel left unrun shows as a gradient far from
eager's (garbage or zeros), not as a bf16 rounding difference.

Usage (repo root): PYTHONPATH=. python3 scripts/step_check.py [case[@BxS] [variant ...]]
(B sequences of S tokens, default the benchmark's 4 x 4096; the fp32 reference at 16384
tokens needs more than an H200's memory: "llama-3.2-1B@8x1024 fp32 eager codetta";
variants: eager, fp32 (the eager model in float32), codetta, codetta+precompile,
codetta:<how> (the model part's setting variants, e.g. codetta:recompute-y); the first is
the reference: "fp32 eager codetta" gives each bf16 run's gradient error)
"""

import copy
import sys

import torch

import codetta
from codetta.bench import model as bm
from codetta.kernels import settings


def main() -> None:
    case, _, shape = (sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1B").partition("@")
    batch, seq = (int(x) for x in shape.split("x")) if shape else (bm.BATCH, bm.SEQ)
    names = sys.argv[2:] or ["eager", "eager again", "codetta", "codetta+precompile"]
    config = bm.model_config(case)
    base = bm.make_model(config)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=g)
    ref_grads, ref_loss = None, None
    for name in names:
        model = copy.deepcopy(base).train()
        if name == "fp32":  # the same weights in float32: a reference for both bf16 runs
            model = model.float()
        if name.startswith("codetta"):
            codetta.apply_codetta(model)

        changes = bm.SETTING_VARIANTS[name.partition(":")[2]] if ":" in name else {}

        def fb(model=model, changes=changes):
            with settings.override(**changes):
                out = model(input_ids=ids, labels=ids, use_cache=False)
                out.loss.backward()
            return out.loss

        if name.endswith("precompile"):
            n = codetta.precompile(fb, model)
            print(f"  precompile: {n} kernels", flush=True)
        loss = fb().float().item()
        grads = {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}
        if ref_grads is None:
            ref_grads, ref_loss = grads, loss
        worst, total_d, total_n = ("", 0.0), 0.0, 0.0
        for k, r in ref_grads.items():
            d = grads[k] - r
            rel = (d.norm() / r.norm().clamp_min(1e-30)).item()
            total_d += d.norm().item() ** 2
            total_n += r.norm().item() ** 2
            if not rel <= worst[1]:
                worst = (k, rel)
        missing = sorted(set(ref_grads) - set(grads))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            fb()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            fb()
        e.record()
        e.synchronize()
        rel_all = (total_d / total_n) ** 0.5
        # (indented: scripts/gpu_call.sh drops lines that start with "codetta:", codetta's log)
        print(f"  {name:<20} loss {loss:.6f} (eager {ref_loss:.6f}); grads vs eager: all {rel_all:.2e}, "
              f"worst {worst[1]:.2e} ({worst[0]}); missing {missing}; fwd+bwd {s.elapsed_time(e) / 5:.1f} ms",
              flush=True)  # fmt: skip
        del model, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
