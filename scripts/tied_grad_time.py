"""Time the tied embedding's one-pass weight gradient (programs/embedding.py) against
PyTorch's three steps (the head's float32 gradient scaled and cast, the embedding's own
backward, their sum), paired timing, on the GPU.

    python scripts/tied_grad_time.py [V D T ...]   (default: Llama-3.2-1B's 128256 2048 16384)
    python scripts/tied_grad_time.py --sweep [V D T]   pass B's tile and warps, uniform ids
    python scripts/tied_grad_time.py --untied [V D T ...]   an untied lookup's gradient
        (embedding_weight_grad) against PyTorch's embedding backward (default: 8B's
        128256 4096 16384)

Ids uniform, skewed (40 % one id) and all one id: the one-pass kernel's time should not
depend on how the ids repeat."""

import sys

import torch

from codetta.kernels.timing import paired_ms
from codetta.programs.ce import scale_cast
from codetta.programs.embedding import embedding_weight_grad, tied_weight_grad


def sweep(V, D, T):
    """Pass B's (rows, block_d, warps) against the default, the whole call timed (paired)."""
    dw32 = torch.randn(V, D, device="cuda")
    scale = torch.tensor(0.5, device="cuda")
    g = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, V, (T,), device="cuda")
    ref = tied_weight_grad(dw32, scale, g, ids, None, torch.bfloat16)
    fns = {(): lambda: tied_weight_grad(dw32, scale, g, ids, None, torch.bfloat16)}
    for rows in (4, 8, 16, 32):
        for block in (128, 256, 512, 1024):
            for warps in (2, 4, 8):
                if rows * block // (32 * warps) > 64:  # over 64 fp32 elements a thread
                    continue
                key = (rows, block, warps)
                fns[key] = lambda key=key: tied_weight_grad(dw32, scale, g, ids, None, torch.bfloat16, key)
                assert torch.equal(fns[key](), ref), key
    t = paired_ms(fns, min_s=2.0)
    base = t[()]
    print(f"pass B sweep, V {V} d {D} T {T}: default (16, 256, 4) {base * 1e3:.1f} us")
    for key, ms in sorted(t.items(), key=lambda kv: kv[1])[:10]:
        print(f"  {str(key or 'default'):<16} {ms * 1e3:8.1f} us  {ms / base:.3f}x  "
              f"{(V * D * 6 + T * D * 2) / (ms * 1e-3) / 1e9:6.0f} GB/s")  # fmt: skip


BF16 = torch.bfloat16


def _ids(V, T, how):
    ids = torch.randint(0, V, (T,), device="cuda")
    if how == "skewed":
        ids[torch.rand(T, device="cuda") < 0.4] = 5
    elif how == "one":
        ids.fill_(7)
    return ids


def untied(nums):
    """The lookup's gradient alone: ours, dense (every row written by pass B) and sparse
    (the table zero-filled, then only the rows some token names), against
    aten.embedding_dense_backward (a zero-filled table, a sum and a scatter over it); then
    the sparse form's launch shapes at the first (V, d, T), uniform ids."""
    print("untied:  V      d      T  ids       torch us  dense us  sparse us  dense/torch  sparse/torch  "
          "max rel diff")  # fmt: skip
    for V, D, T in zip(nums[0::3], nums[1::3], nums[2::3]):
        g = torch.randn(T, D, device="cuda").to(torch.bfloat16)
        for how in ("uniform", "skewed", "one"):
            ids = _ids(V, T, how)
            fns = {
                "torch": lambda g=g, ids=ids, V=V: torch.ops.aten.embedding_dense_backward(g, ids, V, -1, 0),
                "dense": lambda g=g, ids=ids, V=V: embedding_weight_grad(g, ids, None, V, BF16),
                "sparse": lambda g=g, ids=ids, V=V: embedding_weight_grad(g, ids, None, V, BF16, sparse=True),
            }
            want = fns["torch"]().float()
            diff = max((fns[k]().float() - want).abs().max().item() for k in ("dense", "sparse"))
            diff /= want.abs().max().item()
            t = paired_ms(fns, min_s=1.0)
            us = {k: v * 1e3 for k, v in t.items()}
            rd, rs = t["dense"] / t["torch"], t["sparse"] / t["torch"]
            print(f"      {V:>6} {D:>6} {T:>6}  {how:<8} {us['torch']:9.1f} {us['dense']:9.1f} "
                  f"{us['sparse']:10.1f} {rd:12.3f} {rs:13.3f}  {diff:.2e}")  # fmt: skip
    V, D, T = nums[:3]
    g = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    ids = _ids(V, T, "uniform")
    fns = {(): lambda: embedding_weight_grad(g, ids, None, V, torch.bfloat16, sparse=True)}
    for slots in (4, 8, 16):  # (the sparse form's most)
        for block in (256, 512, 1024):
            for warps in (4, 8):
                if slots * block // (32 * warps) <= 64:
                    key = (slots, block, warps)
                    fns[key] = lambda k=key: embedding_weight_grad(g, ids, None, V, torch.bfloat16, k, True)
    t = paired_ms(fns, min_s=2.0)
    print(f"sparse launch sweep, V {V} d {D} T {T}: default (16, 256, 4) {t[()] * 1e3:.1f} us")
    for key, ms in sorted(t.items(), key=lambda kv: kv[1])[:6]:
        print(f"  {str(key or 'default'):<16} {ms * 1e3:8.1f} us  {ms / t[()]:.3f}x")
    seg_sweep(g, ids, V)


def seg_sweep(g, ids, V):
    """Pass A's block of sorted tokens (module constant SEG: 64 spills a 40 B stack frame on
    sm_90a, 32 does not), both forms of the whole gradient, paired."""
    from codetta.programs import embedding

    base = embedding.SEG
    fns = {}
    for seg in (16, 32, 64):  # (128: 393 KB of shared memory, run 130)
        for sparse in (False, True):

            def fn(seg=seg, sparse=sparse):
                embedding.SEG = seg
                try:
                    return embedding_weight_grad(g, ids, None, V, BF16, sparse=sparse)
                finally:
                    embedding.SEG = base

            fns[(seg, sparse)] = fn
    want = fns[(base, False)]().float()
    for key, fn in fns.items():
        assert (fn().float() - want).abs().max().item() <= 1e-2 * want.abs().max().item(), key
    t = paired_ms(fns, min_s=2.0)
    print(f"pass A SEG sweep (V {V}, T {g.shape[0]}, d {g.shape[1]}), whole gradient:")
    for (seg, sparse), ms in sorted(t.items()):
        rel = ms / t[(base, sparse)]
        form = "sparse" if sparse else "dense"
        print(f"  SEG {seg:>4} {form:<6} {ms * 1e3:8.1f} us  {rel:.3f}x SEG {base}")


def main(argv):
    if argv[:1] == ["--sweep"]:
        return sweep(*([int(a) for a in argv[1:4]] or [128256, 2048, 16384]))
    if argv[:1] == ["--untied"]:
        return untied([int(a) for a in argv[1:]] or [128256, 4096, 16384])
    nums = [int(a) for a in argv] or [128256, 2048, 16384]
    print("   V      d      T  ids       torch us   ours us  ours/torch  ours GB/s  max rel err vs torch")
    for V, D, T in zip(nums[0::3], nums[1::3], nums[2::3]):
        dw32 = torch.randn(V, D, device="cuda") * 1e-3
        scale = torch.tensor(0.5, device="cuda")
        g = torch.randn(T, D, device="cuda").to(torch.bfloat16)
        for how in ("uniform", "skewed", "one"):
            ids = _ids(V, T, how)

            def theirs(dw32=dw32, scale=scale, g=g, ids=ids, V=V):
                head = scale_cast(dw32, scale, torch.bfloat16)
                emb = torch.ops.aten.embedding_dense_backward(g, ids, V, -1, False)
                return head + emb

            def ours(dw32=dw32, scale=scale, g=g, ids=ids):
                return tied_weight_grad(dw32, scale, g, ids, None, torch.bfloat16)

            a, b = theirs(), ours()
            err = ((b.float() - a.float()).abs().max() / a.float().abs().max()).item()
            t = paired_ms({"torch": theirs, "ours": ours}, min_s=1.0)
            gbs = (V * D * 6 + T * D * 2) / (t["ours"] * 1e-3) / 1e9
            print(f"{V:>6} {D:>6} {T:>6}  {how:<8} {t['torch'] * 1e3:9.1f} {t['ours'] * 1e3:9.1f} "
                  f"{t['ours'] / t['torch']:10.3f} {gbs:10.0f}  {err:.2e}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
