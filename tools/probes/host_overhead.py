# Probe (CUDA GPU, torch and an installed sage_attn): where a small sageattn call's time goes.
# For D 64/128, causal or not, B=4 H=32 N=1k (and D=64 causal 2k) it prints, per call: the GPU
# time when calls run back to back (what sage_attn.bench times), the host time (enqueue only, no
# sync), each kernel's device time (torch.profiler: the pre-pass kernels and the attention
# kernel), and the same two times for SDPA. A call is host-bound when its host time reaches its
# back-to-back time. Run: python tools/probes/host_overhead.py
import re, sys, time
import torch, sage_attn
from torch.profiler import profile, ProfilerActivity

def per_call_ms(fn, n=200):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); e.synchronize()
    gpu = s.elapsed_time(e) / n
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    return gpu, host

for d, causal, n in [(64, False, 1024), (64, True, 1024), (128, False, 1024), (128, True, 1024),
                     (64, True, 2048)]:
    q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.half) for _ in range(3))
    fn = lambda: sage_attn.sageattn(q, k, v, is_causal=causal)
    gpu, host = per_call_ms(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): fn()
        torch.cuda.synchronize()
    tot = {}
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            m = re.search(r"(\w+_kernel)", ev.name)
            name = m.group(1) if m else ev.name[:30]
            tot[name] = tot.get(name, 0.0) + ev.time_range.elapsed_us() / 5
    sdpa = per_call_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    print(f"D={d} causal={causal} N={n}: back-to-back {gpu*1e3:.1f} us/call, host {host*1e3:.1f} us/call"
          f" | kernels: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(tot.items(), key=lambda x: -x[1]))
          + f" | sdpa {sdpa[0]*1e3:.1f} us (host {sdpa[1]*1e3:.1f})", flush=True)
