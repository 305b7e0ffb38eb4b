# Probe (CUDA GPU, torch and an installed sage_attn): when each kernel of one sageattn call starts
# and ends. Per shape, the call is captured in a CUDA graph (sage_attn.bench.capture_graph) and
# replayed after a GPU sleep, so its launches are all queued before the first runs, under
# torch.profiler (graph_kernels.kernels_of); the kernels' start and end offsets from the first one's
# start are the medians of seven replays. Shows the K/V pre-pass's launches (kv_stats, kv_finalize,
# quant_kv or the one-launch kv_prepass) and how far into the call the attention kernel starts and
# ends (it starts early as a programmatic dependent and waits). --no-smooth-v: the calls without
# V smoothing (K/V's pre-pass from a sample: kv_sample, quant_kv, fix_v). Results in
# bench/results/probes/.
# Run: python tools/probes/prepass_timeline.py [--no-smooth-v]
import re
import statistics
import sys

import torch

import sage_attn
from graph_kernels import kernels_of  # (this script's folder is on sys.path when it is run)
from sage_attn.bench import capture_graph

# (name, B, H, N, D): Flux.1 and SDXL's first level at 1024², prompts of 1k-4k tokens.
SHAPES = [("flux", 1, 24, 4608, 128), ("sdxl", 2, 10, 4096, 64), ("d128-1k", 4, 32, 1024, 128),
          ("d128-2k", 4, 32, 2048, 128), ("d128-4k", 4, 32, 4096, 128),
          ("d64-2k", 4, 32, 2048, 64)]


def short(name):
    """The kernel's function name without namespaces or template arguments."""
    base = name.replace("(anonymous namespace)::", "").split("<")[0].split("(")[0]
    return re.sub(r"^.*::", "", base.replace("void ", ""))[-28:]


def main():
    for name, b, h, n, d in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        smooth_v = False if "--no-smooth-v" in sys.argv[1:] else None  # None: the preset's
        g, _ = capture_graph(lambda: sage_attn.sageattn(q, k, v, smooth_v=smooth_v))
        runs = [kernels_of(g) for _ in range(7)]
        print(f"== {name} B{b} H{h} N{n} D{d}")
        for i, (kn, _, _) in enumerate(runs[0]):
            s = statistics.median(r[i][1] for r in runs)
            e = statistics.median(r[i][2] for r in runs)
            print(f"  {short(kn):28s} start {s:8.1f} end {e:8.1f} dur {e - s:7.1f} us")
        del g


if __name__ == "__main__":
    main()
