# Probe (CUDA GPU, torch and an installed sage_attn): where a sageattn call's time goes.
# 1. Per shape (D 64/128, causal or not, B=4 H=32 N=1k, and a tiny B=1 H=1 N=128 whose GPU work
#    is negligible): the GPU time of back-to-back calls, each kernel's device time
#    (torch.profiler), and the host time of one eager call against SDPA's, measured so that
#    neither waits for the GPU nor drifts apart: each round enqueues a sleep kernel longer than
#    the round's host work, then times one sage call and one SDPA call (perf_counter_ns, each
#    alone, the order alternating by round), then synchronizes. The GPU is busy throughout, so a
#    call's time is its host time; the pairing cancels the machine's drift (enqueue-only timing
#    of separate batches scattered by 2x between same-size shapes on the device). Reported: each
#    side's median and the median of the per-round difference, with its 10-90 % range.
# 2. The host time of each step of the eager call (Python checks, the cached plan, the two
#    allocations, the argument struct, the C call, the C call's launches alone) at the tiny shape.
# 3. The SDPA drop-in's hand-off to torch taken apart (ViT-L/14 224² at B 1, under the length
#    shortcut, and Flux.1 1024², through the signature): torch's SDPA binding called bare, from
#    one Python frame, after the query reads the shortcut makes, after torch.compiler's test,
#    after the drop-in's route lookup, and the drop-in itself; all in one paired batch a round
#    (sage_attn.bench.paired_host_us: the GPU held by a sleep, the order rotated by round), each
#    read as its per-round difference to the bare call.
# Run: python tools/probes/host_overhead.py [--rounds N] [--parts 1,2,3]
import argparse
import re
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import sage_attn
from sage_attn import _lib
from sage_attn.bench import _sleep_cycles_per_ms, host_us, paired_summary, time_ms
from sage_attn.bench import paired_host_us as bench_paired
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


def paired_host_us(fn_a, fn_b, rounds):
    """(median a, median b, median a-b, 10th and 90th percentile of a-b), host microseconds of
    one call each, the GPU held busy by a sleep kernel (see the header)."""
    fn_a(), fn_b()
    torch.cuda.synchronize()
    a, b = [], []
    for r in range(rounds):
        torch.cuda._sleep(2_000_000)  # ~1 ms at the H100/H200's clocks: covers the round
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn = fn_a if which == 0 else fn_b
            t0 = time.perf_counter_ns()
            fn()
            (a if which == 0 else b).append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    d = sorted(x - y for x, y in zip(a, b))
    return (statistics.median(a), statistics.median(b), statistics.median(d),
            d[len(d) // 10], d[(9 * len(d)) // 10])


def shapes():
    for b, h, n in [(1, 1, 128), (4, 32, 1024)]:
        for d in (64, 128):
            for causal in (False, True):
                yield b, h, n, d, causal


ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rounds", type=int, default=400, help="paired rounds a shape (default 400)")
ap.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
opts = ap.parse_args()
parts = {int(x) for x in opts.parts.split(",") if x}

if 1 in parts:
    print("1. per call, microseconds (host: one eager call, paired with SDPA's, GPU held busy)")
for b, h, n, d, causal in (shapes() if 1 in parts else ()):
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.half) for _ in range(3))
    fn = lambda: sage_attn.sageattn(q, k, v, is_causal=causal)  # noqa: E731
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    drop = lambda: sage_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    hs, hd, diff, lo, hi = paired_host_us(fn, sdpa, opts.rounds)
    dd = paired_host_us(drop, sdpa, opts.rounds)
    print(f"B={b} H={h} N={n} D={d} causal={int(causal)}: gpu sage {gpu_us(fn):.1f} sdpa "
          f"{gpu_us(sdpa):.1f} | host sageattn {hs:.1f} sdpa {hd:.1f} diff {diff:+.1f} "
          f"[{lo:+.1f}, {hi:+.1f}] | drop-in ({sage_attn.dropin_backend(q, k, v, is_causal=causal)}) "
          f"{dd[0]:.1f} diff {dd[2]:+.1f} [{dd[3]:+.1f}, {dd[4]:+.1f}] | kernels: {kernels_us(fn)}",
          flush=True)


def part2():
    print("2. the steps of one eager call (B=1 H=1 N=128 D=128 causal), host microseconds")
    q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.half) for _ in range(3))
    mask, scale = _lib.MASK_CAUSAL_BOTTOM_RIGHT, 128 ** -0.5
    call = T._Call(q, k, v, _lib.LAYOUT_HND, mask, scale, None, None, True, None, False, T._RAISE,
                  _lib.KERNEL_AUTO)
    T._attention(call)
    prep = T._prepared[T._key(call)]
    o = torch.empty_like(q)
    ws = torch.empty(prep.workspace, dtype=torch.uint8, device="cuda")
    a = _lib.AttentionArgs.from_buffer_copy(prep.args)
    a.q, a.k, a.v, a.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    a.stream = T._current_stream(q.device)
    a.workspace, a.workspace_size = ws.data_ptr(), prep.workspace
    steps = {
        "sageattn (all)": lambda: sage_attn.sageattn(q, k, v, is_causal=True),
        "_attention (op body)": lambda: T._attention(call),
        "_check_tensors": lambda: T._check_tensors(q, k, v, "HND"),
        "_call's eager test": lambda: T._call.__code__ and (type(q) is torch.Tensor and
                                                            not torch.compiler.is_compiling()),
        "_key + dict lookup": lambda: T._prepared.get(T._key(call)),
        "drop-in: route lookup (checks, route, plan)": lambda: T._dropin_route_of(
            q, k, v, None, 0.0, True, None, False),
        "new_empty (o)": lambda: q.new_empty(q.shape),
        "new_empty (workspace)": lambda: q.new_empty(prep.workspace_alloc),
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


def part3():
    print("3. the drop-in's hand-off to torch, host microseconds a call minus torch's SDPA "
          "binding's (median over rounds [10-90 %])")
    sdpa = torch._C._nn.scaled_dot_product_attention
    cycles_per_ms = _sleep_cycles_per_ms()

    def frame(q, k, v):
        return sdpa(q, k, v, None, 0.0, False)

    def reads(q, k, v):
        q.shape, q.dtype, q.device  # noqa: B018 (what the length shortcut reads)
        return sdpa(q, k, v, None, 0.0, False)

    def compiling(q, k, v):
        if torch.compiler.is_compiling():
            return None
        return sdpa(q, k, v, None, 0.0, False)

    def route(q, k, v):
        T._dropin_route_of(q, k, v, None, 0.0, False, None, False)
        return sdpa(q, k, v, None, 0.0, False)

    for name, b, h, n, d in (("vit-l/14 224²", 1, 16, 257, 64),
                             ("flux.1 1024²", 1, 24, 4608, 128)):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.half) for _ in range(3))
        fns = {"sdpa": lambda: sdpa(q, k, v), "frame": lambda: frame(q, k, v),
               "reads": lambda: reads(q, k, v), "compiling": lambda: compiling(q, k, v),
               "route": lambda: route(q, k, v),
               "drop-in": lambda: sage_attn.scaled_dot_product_attention(q, k, v)}
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for fn in fns.values():
            for _ in range(10):
                fn()
        cycles = int(cycles_per_ms * max(1.0, 3e3 * (time.perf_counter() - t0)))
        torch.cuda.synchronize()
        times = bench_paired(fns, opts.rounds, 10, lambda: torch.cuda._sleep(cycles),
                             torch.cuda.synchronize)
        route_name = "shortcut" if T._dropin_route_of(q, k, v, None, 0.0, False, None,
                                                      False) is T._SHORT else "signature"
        print(f"  {name} B={b} ({sage_attn.dropin_backend(q, k, v)}, {route_name}): sdpa "
              f"{statistics.median(times['sdpa']):.2f} | " + " | ".join(
                  "{} {:+.2f} [{:+.2f}, {:+.2f}]".format(
                      x, *paired_summary(times, x, "sdpa")[1:]) for x in fns if x != "sdpa"),
              flush=True)


if 2 in parts:
    part2()
if 3 in parts:
    part3()
