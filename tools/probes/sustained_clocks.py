# Probe (CUDA GPU, torch, nvidia-smi and an installed sage_attn): one attention call's graph per
# implementation (sage-8b, SDPA cuDNN), each replayed back to back for a stretch of its own
# ("sustained") while a thread samples the GPU's SM clock and power draw through nvidia-smi, then
# the same graphs timed replay by replay in turn (sage_attn.bench.interleaved_ms). Does an
# implementation's own power draw move the clock it runs at, and by how much does that move
# the comparison between timing in stretches and timing in turn?
# Run: python tools/probes/sustained_clocks.py [--shape flux|wan|sdxl|llama8k] [--seconds S]
import argparse
import statistics
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sage_attn
from sage_attn.bench import capture_graph, interleaved_ms

SHAPES = {"flux": (1, 24, 4608, 128, False), "wan": (1, 40, 32760, 128, False),
          "sdxl": (2, 10, 4096, 64, False), "llama8k": (1, 32, 8192, 128, True)}


class Sampler(threading.Thread):
    """(phase, SM MHz, W) samples from nvidia-smi, tagged with the phase current when taken."""

    def __init__(self):
        super().__init__(daemon=True)
        self.phase, self.samples, self.stop = None, [], False

    def run(self):
        while not self.stop:
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True).stdout.split("\n")[0]
            try:
                mhz, watts = (float(x) for x in out.split(","))
            except ValueError:
                continue
            self.samples.append((self.phase, mhz, watts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="flux")
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    b, h, n, d, causal = SHAPES[a.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=torch.float16)
               for _ in range(3))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    fns = {"sage-8b": lambda: sage_attn.sageattn(q, k, v, is_causal=causal), "sdpa-cudnn": cudnn}
    sampler = Sampler()
    sampler.start()
    print(f"{a.shape}: B {b} H {h} N {n} D {d} causal {causal}")
    for name, fn in fns.items():
        graph, calls = capture_graph(fn)
        sampler.phase = None
        time.sleep(1.0)  # the GPU idles, its clock recovers
        times, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            times.append((s, e))
            if time.perf_counter() - t0 > a.seconds / 2:
                sampler.phase = name  # (the second half: the clock has settled)
            if len(times) > 2:  # (at most three replays queued: the host's time is the GPU's)
                times[-3][1].synchronize()
        torch.cuda.synchronize()
        sampler.phase = None
        ms = [s.elapsed_time(e) / calls for s, e in times[len(times) // 2:]]
        mine = [(m, w) for p, m, w in sampler.samples if p == name]
        print(f"sustained {name:11s} {statistics.median(ms):.4f} ms, SM clock "
              f"{statistics.median(m for m, _ in mine) if mine else float('nan'):.0f} MHz, power "
              f"{statistics.median(w for _, w in mine) if mine else float('nan'):.0f} W "
              f"({len(mine)} samples)")
        del graph
    sampler.stop = True
    for name, ms in interleaved_ms(fns, a.seconds, 4, print).items():
        print(f"in turn   {name:11s} {ms:.4f} ms")


if __name__ == "__main__":
    main()
