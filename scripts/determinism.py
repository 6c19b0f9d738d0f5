"""Bitwise run-to-run determinism of the RoPE programs, per candidate configuration (GPU).

Each program runs twice per configuration on the same operands (fresh random data,
outputs poisoned with NaN in between); a configuration whose two outputs differ in
any bit is reported with the largest difference. Then the q/k/v module against the
functional op with its parameters, three calls each (tests/test_rope.py::test_module).

Usage: python scripts/determinism.py [--programs rms_qknorm_rope_pairs_64 ...]
"""

import argparse
import dataclasses

import torch

import codetta
from codetta import programs as pg
from codetta.kernels.engines import PINGPONG, TRITON


def operands(prog, M, N):
    f32 = dict(device="cuda", dtype=torch.float32)
    ops = {"sumsq": torch.rand(M, **f32) * 64 + 1, "inv_d": 1 / 64, "eps": 1e-6,
           "pos": torch.randint(0, 4096, (M,), device="cuda"), "freq": torch.rand(N, **f32) * 0.1,
           "scaling": 0.9}  # fmt: skip
    if "qknorm" in prog.name:
        ops.update(qk_w=torch.rand(N, **f32) + 0.5, qk_eps=1e-6)
    return ops


def programs_check(names, shapes=((1000, 2048, 2048), (8192, 2048, 2048)), reps=20):
    """Each candidate (and the same with the tail split off) ``reps`` times; where runs
    differ, the 128-row x 64-column blocks the differences fall in."""
    torch.manual_seed(0)
    for M, N, K in shapes:
        y = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
        for name in names:
            if name == "rotate_pairs":  # (per-row cos and sin)
                prog = pg.ROTATE_PAIRS
                ops = {"cos": torch.rand(M, device="cuda"), "sin": torch.rand(M, device="cuda")}
            else:
                table, hd = name.rsplit("_", 1)
                prog = getattr(pg, table.upper())[int(hd)]
                ops = operands(prog, M, N)
            cands = TRITON.candidates(prog) + PINGPONG.candidates(prog)
            cands += [dataclasses.replace(c, tail_split=1) for c in cands if c.tail_split > 1]
            for cfg in cands:
                try:
                    outs = []
                    for _ in range(reps):
                        r = codetta.gemm(y, w, epilogue=prog, config=cfg, **ops)
                        outs.append(r[0] if isinstance(r, tuple) else r)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    print(
                        f"{M:5d} {name:26s} {cfg.short():26s} failed: {type(exc).__name__}: {str(exc)[:80]}"
                    )
                    continue
                bad = [i for i, o in enumerate(outs[1:], 1) if not torch.equal(o, outs[0])]
                where = ""
                if bad:
                    o = outs[bad[0]]
                    diff = (o.float() - outs[0].float()).abs()
                    rows, cols = torch.nonzero(diff).unbind(1)
                    blocks = sorted({(int(r) // 128, int(c) // 64) for r, c in zip(rows, cols)})
                    where = (f" max diff {diff.max().item():.2e}, {len(rows)} elements, row/col blocks "
                             f"{blocks[:8]}{'...' if len(blocks) > 8 else ''}")  # fmt: skip
                print(f"{M:5d} {name:26s} {cfg.short():26s} {len(bad):2d}/{reps - 1} runs differ{where}")


def module_check():
    from codetta.nn import RMSNormQKVRoPE
    from codetta.ops import RoPE, rmsnorm_linear

    B, S, d, hq, hkv, hd = 2, 500, 2048, 32, 8, 64
    for qk_norm in (False, True):
        for inter in (False, True):
            torch.manual_seed(1)
            m = RMSNormQKVRoPE(d, hq, hkv, hd, rope_theta=500.0, eps=1e-6, qk_norm=qk_norm, interleaved=inter,
                               device="cuda", dtype=torch.bfloat16)  # fmt: skip
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * d**-0.5)
            x = torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
            pos = torch.arange(S, device="cuda").repeat(B, 1)
            qk = (m.q_norm.weight, m.k_norm.weight) if qk_norm else ()
            rope = RoPE(pos, m.inv_freq, qk_norm_weights=qk, qk_norm_eps=1e-6, interleaved=inter)
            ws = [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]
            mods = [[t.transpose(1, 2).reshape(B, S, -1) for t in m(x, pos)] for _ in range(3)]
            fns = [rmsnorm_linear(x, m.norm.weight, ws, 1e-6, rope=rope) for _ in range(3)]
            for i, label in enumerate("qkv"):
                runs = [r[i] for r in mods + fns]
                d_ = [(r.float() - runs[0].float()).abs().max().item() for r in runs]
                print(f"module qk_norm={qk_norm!s:5} interleaved={inter!s:5} {label}: "
                      f"max diff to the module's first call, module x3 then op x3: "
                      + " ".join(f"{v:.2e}" for v in d_))  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ["rms_rope_pairs_64", "rms_rope_64", "rms_qknorm_rope_pairs_64", "rotate_pairs"]
    ap.add_argument("--programs", nargs="*", default=names)
    ap.add_argument("--module", action="store_true", help="also the q/k/v module against the op")
    ap.add_argument("--shapes", nargs="*", default=["1000x2048x2048", "1024x2048x2048", "8192x2048x2048"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.module:
        module_check()
    programs_check(args.programs, [tuple(int(x) for x in s.split("x")) for s in args.shapes], args.reps)
