"""Is bench qkv's sustained column set by the host? (GPU machine)

Times each variant's forward + backward of ``codetta.bench.qkv`` as the benchmark does
(paired and sustained blocks) and the same call replayed from a CUDA graph (no Python,
no launch overhead: the GPU's own time). Where a variant's sustained ratio to cuBLAS
falls when both are replayed from graphs, the host issued its calls slower than the
GPU ran them.

Usage: python scripts/graph_qkv.py [case ...] [--one-launch]   (default: 8B qwen3-8B;
--one-launch adds codetta with CODETTA_QKV_ONE_LAUNCH=1, launched and graphed)
"""

import sys

import torch

from codetta.bench import qkv
from codetta.bench.harness import host_ms, with_settings
from codetta.kernels.timing import paired_ms, sustained_ms


def graphed(run):
    """``run`` captured once into a CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph.replay


def main(cases, flags=()):
    for case in cases:
        p = qkv.problem(case)
        fns = {"cublas": qkv.cublas_gemms(p, backward=True), "codetta": qkv.fwd_bwd(p, qkv.codetta)}
        if "--one-launch" in flags:  # q, k, v (and their dW) from one launch each
            fns["codetta:one"] = with_settings(qkv.fwd_bwd(p, qkv.codetta), qkv_one_launch=True)
        for name in list(fns):
            fns[name + "-graph"] = graphed(fns[name])
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        host = {k: host_ms(fn) for k, fn in fns.items()}
        paired = paired_ms(fns)
        sustained = sustained_ms(fns)
        print(f"== {case} fwd+bwd, ms (x cuBLAS of the same launch kind)")
        for k in fns:
            base = "cublas-graph" if k.endswith("-graph") else "cublas"
            pr, su = paired[k] / paired[base], sustained[k] / sustained[base]
            print(f"  {k:16s} paired {paired[k]:7.3f} (x{pr:.3f})  sustained {sustained[k]:7.3f} (x{su:.3f}) "
                  f" host {host[k]:6.3f}")  # fmt: skip


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args or ["8B", "qwen3-8B"], [a for a in sys.argv[1:] if a.startswith("--")])
