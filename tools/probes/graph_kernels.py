# Probe (CUDA GPU, torch and an installed sage_attn): what a CUDA graph of one attention call
# holds, per implementation of bench_models' rows (sage, SDPA cuDNN, SDPA with torch's own
# choice, the drop-in): each graph is captured as bench_models captures it (warm-up on a side
# stream, then one call), replayed once under torch.profiler after a GPU sleep, and its kernels
# are listed with their device times; then every implementation's time under graph replay
# (sage_attn.bench.interleaved_ms). For the drop-in calls that hand a call to torch: does
# the graph hold torch's kernel, and the same one as torch's own call?
# Run: python tools/probes/graph_kernels.py [--shape flux|sdxl|pixart|auraflow|wan|mochi]
#      [--rounds N]
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import sage_attn
from sage_attn.bench import capture_graph, interleaved_ms

SHAPES = {"flux": (1, 24, 4608, 128), "sdxl": (2, 10, 4096, 64), "pixart": (2, 16, 4096, 72),
          "auraflow": (2, 24, 4352, 128), "wan": (1, 40, 32760, 128), "mochi": (1, 24, 44520, 128)}


def kernels_of(graph):
    """[(kernel name, start µs, end µs)] of one replay of the graph, in start order, the times
    from the first kernel's start (tools/probes/prepass_timeline.py reads them too)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(100_000)  # the replay queues behind it, so none of its launches waits
        graph.replay()
        torch.cuda.synchronize()
    # (torch.cuda._sleep's kernel, at::cuda's spin_kernel, need not say "sleep" in its name)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and "sleep" not in e.name and "spin_kernel" not in e.name]
    events.sort(key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    return [(e.name, e.time_range.start - t0, e.time_range.end - t0) for e in events]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="flux")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    a = ap.parse_args()
    b, h, n, d = SHAPES[a.shape]
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=dtype)
               for _ in range(3))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    fns = {"sage-8b": lambda: sage_attn.sageattn(q, k, v),
           "sdpa-cudnn": cudnn,
           "sdpa-default": lambda: F.scaled_dot_product_attention(q, k, v),
           "sdpa-dropin": lambda: sage_attn.scaled_dot_product_attention(q, k, v)}
    print(f"{a.shape}: B {b} H {h} N {n} D {d} {a.dtype}; the drop-in's choice:",
          sage_attn.dropin_backend(q, k, v))
    graphs = {name: capture_graph(fn)[0] for name, fn in fns.items()}
    for name, graph in graphs.items():
        print(f"-- {name}")
        for kernel, start, end in kernels_of(graph):
            print(f"   {end - start:9.1f} us  {kernel[:110]}")
    del graphs
    times = interleaved_ms(fns, 0.25, a.rounds, print)
    for name, ms in times.items():
        print(f"{name:13s} {ms:.4f} ms")


if __name__ == "__main__":
    main()
