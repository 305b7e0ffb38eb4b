# Probe (CUDA GPU, torch and an installed sage_attn): where a sageattn call's time goes.
# 1. Per shape (D 64/128, causal or not, B=4 H=32 N=1k, and a tiny B=1 H=1 N=128 whose GPU work
#    is negligible): the GPU time of back-to-back calls, the host time of a call (enqueue only,
#    no sync, few enough calls that the launch queue never fills), each kernel's device time
#    (torch.profiler), and the same two times for SDPA.
# 2. The host time of each step of the eager call (Python checks, the cached plan, the two
#    allocations, the argument struct, the C call, the C call's launches alone) at the tiny shape.
# Run: python tools/probes/host_overhead.py
import re
import torch
from torch.profiler import ProfilerActivity, profile

import sage_attn
from sage_attn import _lib
from sage_attn.bench import host_us, time_ms
from sage_attn import _torch as T


def gpu_us(fn):
    return time_ms(fn, 0.05) * 1e3


def kernels_us(fn, n=5):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            m = re.search(r"(\w+_kernel)", ev.name)
            name = m.group(1) if m else ev.name[:30]
            tot[name] = tot.get(name, 0.0) + ev.time_range.elapsed_us() / n
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(tot.items(), key=lambda x: -x[1]))


def shapes():
    for b, h, n in [(1, 1, 128), (4, 32, 1024)]:
        for d in (64, 128):
            for causal in (False, True):
                yield b, h, n, d, causal


print("1. per call, microseconds")
for b, h, n, d, causal in shapes():
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.half) for _ in range(3))
    fn = lambda: sage_attn.sageattn(q, k, v, is_causal=causal)  # noqa: E731
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    print(f"B={b} H={h} N={n} D={d} causal={int(causal)}: sage gpu {gpu_us(fn):.1f} host "
          f"{host_us(fn, 0.0):.1f} | sdpa gpu {gpu_us(sdpa):.1f} host {host_us(sdpa, 0.0):.1f} | "
          f"kernels: "
          f"{kernels_us(fn)}", flush=True)

print("2. the steps of one eager call (B=1 H=1 N=128 D=128 causal), host microseconds")
q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.half) for _ in range(3))
mask, scale = _lib.MASK_CAUSAL_BOTTOM_RIGHT, 128 ** -0.5
args = (q, k, v, _lib.LAYOUT_HND, mask, scale, None, None, True, None, False, T._RAISE,
        _lib.KERNEL_AUTO)
T._attention(*args)
key = T._key(q, k, v, _lib.LAYOUT_HND, mask, scale, None, None, True, None, False,
             _lib.KERNEL_AUTO)
prep = T._prepared[key]
o = torch.empty_like(q)
ws = torch.empty(prep.workspace, dtype=torch.uint8, device="cuda")
a = _lib.AttentionArgs.from_buffer_copy(prep.args)
a.q, a.k, a.v, a.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
a.stream = T._current_stream(q.device)
a.workspace, a.workspace_size = ws.data_ptr(), prep.workspace
steps = {
    "sageattn (all)": lambda: sage_attn.sageattn(q, k, v, is_causal=True),
    "_attention (op body)": lambda: T._attention(*args),
    "_check_tensors": lambda: T._check_tensors(q, k, v, "HND"),
    "_call's eager test": lambda: T._call.__code__ and (type(q) is torch.Tensor and
                                                        not torch.compiler.is_compiling()),
    "_key + dict lookup": lambda: T._prepared.get(T._key(q, k, v, _lib.LAYOUT_HND, mask, scale,
                                                          None, None, True, None, False,
                                                          _lib.KERNEL_AUTO)),
    "new_empty (o)": lambda: q.new_empty(q.shape),
    "new_empty (workspace)": lambda: q.new_empty((prep.workspace,), dtype=torch.uint8),
    "current device + stream": lambda: (torch.cuda.current_device(),
                                        T._current_stream(q.device)),
    "args copy + 8 fields": lambda: _lib.AttentionArgs.from_buffer_copy(prep.args),
    "C sage_attention (validate, plan, launches)": lambda: _lib.run(a),
    "C sage_attention_plan (validate, plan)": lambda: _lib.plan(a),
    "sdpa (all)": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                           is_causal=True),
}
for name, fn in steps.items():
    print(f"  {name:45s} {host_us(fn, 0.0, calls=50, samples=15):7.2f}", flush=True)
