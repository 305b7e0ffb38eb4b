# Per-kernel device time of one sageattn call (torch.profiler): where the end-to-end time goes.
import torch, sage_attn
from torch.profiler import profile, ProfilerActivity
for n in (1024, 4096, 16384):
    q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.half) for _ in range(3))
    for _ in range(3):
        sage_attn.sageattn(q, k, v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            sage_attn.sageattn(q, k, v)
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            import re
            m = re.search(r"(\w+_kernel)", e.name)
            name = m.group(1) if m else e.name[:40]
            tot[name] = tot.get(name, 0.0) + e.time_range.elapsed_us() / 5
    mb = 3 * q.numel() * 2 / 1e6
    print(f"N={n} (Q+K+V fp16 = {mb:.0f} MB):", ", ".join(f"{k} {v:.1f} us" for k, v in sorted(tot.items(), key=lambda x: -x[1])))
