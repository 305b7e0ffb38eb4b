"""python -m sage_attn.bench: the standard grid (docs/performance.md) with the baselines in the same
process. For every (head_dim, N, causal) and implementation: eager end-to-end TOPS (fp16 in, fp16
out, CUDA events, median of samples), TOPS under CUDA-graph replay (the GPU's time alone: the
figure the bar is judged on; a shape's implementations timed in turn at a shared clock,
interleaved_ms), host microseconds per eager call, sage's kernel-only TOPS (the
attention kernel's own duration read with torch.profiler/CUPTI), cuDNN's FP8 attention on inputs
quantized beforehand (kernel-only, the anchor), and accuracy (cos, rel-L1, RMSE, max-abs) against
float64 on the first heads. Writes <out>/<date>-<gpu>[-tag].json (the fields of
_bench_common.ROW_FIELDS, host_us and the SDPA drop-in's choice among them) and a PNG plot (TOPS
vs N per head dim and mask, the paper's Fig. 5); prints a table per implementation and, last,
the summary the bar reads."""
from __future__ import annotations

import contextlib
import datetime
import math
import pathlib
import statistics
import subprocess
import sys
import time
import warnings

import sage_attn

from ._bench_common import (IMPLS, cuda_missing, flops, gpu_slug, impl_table, new_row,
                            parse_args, plot, summary_table, tops, write_json)

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ._bench_cudnn import CudnnFp8Attention
except ImportError:  # --help and argument errors work without torch; main() says it is needed
    torch = None

__all__ = ["IMPLS", "main"]


def reference64(q, k, v, causal, scale=None, rows=None, top_left=False):
    """float64 attention of [H, N, D] tensors on their device, queries in chunks (memory bound
    by rows x Nk doubles per head); causal is bottom-right aligned unless top_left."""
    q, k, v = q.double(), k.double(), v.double()
    hq, nq, d = q.shape
    hkv, nk = k.shape[0], k.shape[1]
    if hkv != hq:
        k = k.repeat_interleave(hq // hkv, 0)
        v = v.repeat_interleave(hq // hkv, 0)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if rows is None:  # about 2 GiB of float64 scores per chunk
        rows = max(64, (1 << 28) // max(1, hq * nk))
    out = torch.empty_like(q)
    for r0 in range(0, nq, rows):
        s = torch.einsum("hqd,hkd->hqk", q[:, r0:r0 + rows], k) * scale
        if causal:
            i = torch.arange(r0, min(r0 + rows, nq), device=q.device)[:, None]
            j = torch.arange(nk, device=q.device)[None, :]
            s.masked_fill_(j > i + (0 if top_left else nk - nq), float("-inf"))
        out[:, r0:r0 + rows] = torch.softmax(s, dim=-1).nan_to_num_(0.0) @ v
    return out


def accuracy(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    d = o - r
    return {"cos": float((o @ r) / (o.norm() * r.norm()).clamp_min(1e-300)),
            "rel_l1": float(d.abs().sum() / r.abs().sum().clamp_min(1e-300)),
            "rmse": float(d.square().mean().sqrt()), "max_abs": float(d.abs().max())}


def time_ms(fn, target_s=0.25, samples=5):
    """Median per-call milliseconds over `samples` event-timed batches after warm-up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    iters = max(1, min(200, int(target_s * 1e3 / samples / once)))
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def kernel_ms(fn, name="attention_kernel", calls=3):
    """Mean device time of the kernels whose name contains `name`, per call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's notes about its own cycles
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    total_us = 0.0
    for e in prof.events():
        if name in e.name and str(getattr(e, "device_type", "")).endswith("CUDA"):
            total_us += e.time_range.elapsed_us()
    return total_us / calls / 1e3 if total_us > 0 else None


def make_inputs(b, h, n, d, kind, gen):
    def one(bias):
        x = torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=torch.float16)
        if kind == "bias" and bias:
            x += bias * torch.randn((1, h, 1, d), generator=gen, device="cuda", dtype=torch.float16)
        return x
    return one(4.0), one(8.0), one(8.0)  # q, k, v (the channel-bias inputs of docs/performance.md)


def capture_graph(fn, est_ms=None):
    """(graph, calls): warm-up on a side stream (as torch documents for capture), then a few
    calls captured into one CUDA graph (enough for about 2 ms of work per replay)."""
    calls = 1 if not est_ms else max(1, min(10, int(2.0 / est_ms)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph, calls


def graph_ms(fn, target_s=0.25, est_ms=None):
    """Median GPU milliseconds per call under CUDA-graph replay (capture_graph), replays timed
    with time_ms."""
    graph, calls = capture_graph(fn, est_ms)
    try:
        return time_ms(graph.replay, target_s) / calls
    finally:
        del graph


def pair_circuit(n):
    """A cyclic order of range(n) in which every ordered pair of distinct items stands next to
    each other exactly once (an Euler circuit of the complete directed graph: n·(n-1) places,
    each item n-1 times, after each other item once); [0] for n = 1."""
    if n < 2:
        return [0] * n
    left = {u: [v for v in range(n) if v != u] for u in range(n)}
    stack, circuit = [0], []
    while stack:  # Hierholzer's walk
        u = stack[-1]
        if left[u]:
            stack.append(left[u].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1][:-1]


def interleaved_ms(fns, target_s, rounds, report, event=None, sync=None):
    """name -> GPU ms per call under CUDA-graph replay; None for one that failed. The
    implementations' graphs are replayed in turn, each replay between its own pair of events, in
    the order of pair_circuit: each implementation follows every other one equally often. The
    clock a replay runs at depends on the power drawn before it (at its power limit the GPU
    lowers the clock for a kernel that draws more: docs/performance.md), so a fixed order
    favours whichever follows the frugal one, and timing each graph for a stretch of its own
    gives each the clock of its own power draw instead of a shared one. The circuits (enough
    for about target_s of each implementation, at least one a round) are queued in `rounds`
    batches, each after an untimed replay of the circuit's last implementation, and read after
    the batch's synchronize. The figure: per circuit the mean of an implementation's replays,
    then the median over circuits. event/sync: a timing-event factory and a device synchronize
    (torch.cuda's by default)."""
    graphs, est = {}, {}
    for name, fn in fns.items():
        try:
            once = time_ms(fn, target_s=0.02, samples=2)
            graphs[name] = capture_graph(fn, once)
            est[name] = once * graphs[name][1]
        except Exception as e:  # a report, not a reason to stop
            report(f"{name} failed ({type(e).__name__}: {str(e).splitlines()[0]})")
    names = list(graphs)
    if not names:
        return {name: None for name in fns}
    event = event or (lambda: torch.cuda.Event(enable_timing=True))
    sync = sync or torch.cuda.synchronize
    order = [names[i] for i in pair_circuit(len(names))]
    per_impl = max(1, len(names) - 1)  # an implementation's replays a circuit
    circuits = max(1, math.ceil(target_s * 1e3 / rounds /
                                (per_impl * statistics.mean(est.values()))))
    means = {name: [] for name in names}
    for _ in range(rounds):
        graphs[order[-1]][0].replay()  # (the first timed replay's predecessor, as in the circuit)
        marks = []
        for _ in range(circuits):
            for name in order:
                start, end = event(), event()
                start.record()
                graphs[name][0].replay()
                end.record()
                marks.append((name, start, end))
        sync()
        for c in range(circuits):
            mine = {name: [] for name in names}
            for name, start, end in marks[c * len(order):(c + 1) * len(order)]:
                mine[name].append(start.elapsed_time(end) / graphs[name][1])
            for name in names:
                means[name].append(statistics.mean(mine[name]))
    del graphs
    return {name: statistics.median(means[name]) if name in means else None for name in fns}


def host_us(fn, est_ms, calls=20, samples=5):
    """Median CPU microseconds per eager call: back-to-back calls started right after a
    synchronize, few enough (at most `calls`, and about 50 ms of GPU work) that the launch queue
    never fills and no call waits for the GPU."""
    n = max(2, min(calls, int(50.0 / max(est_ms, 1e-3))))
    per_call = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def paired_host_us(fns, rounds, calls, hold, sync, clock=time.perf_counter):
    """name -> the host microseconds per call of each round (a list, one a round) of each eager
    function in fns. A round: hold() (a GPU sleep longer than the round's host work: every
    launch queues behind it, so none waits for the GPU and none finds it idle), then `calls`
    calls of each function timed as one batch, the functions' order rotated by round so that a
    drift of the machine weighs on all alike, then sync(). Few calls a batch keep the launch
    queue far from full."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        hold()
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            t0 = clock()
            for _ in range(calls):
                fn()
            times[name].append((clock() - t0) / calls * 1e6)
        sync()
    return times


def paired_summary(times, name, base):
    """(median µs of name, median of its per-round difference to base, that difference's 10th
    and 90th percentiles): each round's pair ran back to back, so the difference is read per
    round rather than between medians."""
    d = sorted(x - y for x, y in zip(times[name], times[base]))
    return (statistics.median(times[name]), statistics.median(d), d[len(d) // 10],
            d[(9 * len(d)) // 10])


# (call, B, H, N, D) of --host-time: ViT-L/14 at 224² (257 tokens, 16 heads of 64), DiT-XL/2 at
# 256² (256 patches, 16 heads of 72), Flux.1 at 1024² (4096 image + 512 text tokens, 24 of 128).
HOST_SHAPES = (("vit-l/14 224²", 1, 16, 257, 64), ("vit-l/14 224²", 2, 16, 257, 64),
               ("vit-l/14 224²", 4, 16, 257, 64), ("vit-l/14 224²", 8, 16, 257, 64),
               ("dit-xl/2 256²", 1, 16, 256, 72), ("dit-xl/2 256²", 2, 16, 256, 72),
               ("flux.1 1024²", 1, 24, 4608, 128))


def _sleep_cycles_per_ms():
    """torch.cuda._sleep's cycles per millisecond on this GPU (its clock, timed once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1_000_000 / max(start.elapsed_time(end), 1e-3)


def host_time(args, gpu, commit):
    """--host-time: the eager host time per call of torch's SDPA, sageattn, the SDPA drop-in (as
    it routes, and with the crossover off: sage wherever it can) and the official-API alias's
    sageattn (as it routes) at HOST_SHAPES, non-causal fp16, each paired with SDPA round by round
    (paired_host_us). Prints a table, writes <out>/<date>-<gpu>[-tag]-host.json."""
    import json
    dtype = torch.float16
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed if args.seed is not None else 0)
    cycles_per_ms = _sleep_cycles_per_ms()
    sdpa = F.scaled_dot_product_attention
    if getattr(sdpa, "__module__", "").startswith("sage_attn"):
        sdpa = torch._C._nn.scaled_dot_product_attention  # (torch's own, not a patched one)
    dropin = sage_attn.scaled_dot_product_attention
    from . import sageattention as alias  # the official-API alias (diffusers, ComfyUI)
    rows = []
    print("| call | B | H | N | D | SDPA µs | sageattn µs | drop-in route | drop-in µs | "
          "drop-in − SDPA µs [10-90 %] | drop-in, crossover off µs | "
          "its − SDPA µs [10-90 %] | alias − SDPA µs [10-90 %] |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for call, b, h, n, d in HOST_SHAPES:
        q, k, v = (torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=dtype)
                   for _ in range(3))
        fns = {"sdpa": lambda: sdpa(q, k, v), "sageattn": lambda: sage_attn.sageattn(q, k, v),
               "dropin": lambda: dropin(q, k, v), "alias": lambda: alias.sageattn(q, k, v)}
        # The round's host work, timed once unheld (every call warm), sets the sleep: thrice it.
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for fn in fns.values():
            for _ in range(args.host_calls):
                fn()
        round_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        cycles = int(cycles_per_ms * max(1.0, 3 * round_ms))

        def measure(fns):
            return paired_host_us(fns, args.host_rounds, args.host_calls,
                                  lambda: torch.cuda._sleep(cycles), torch.cuda.synchronize)

        row = {"call": call, "batch": b, "heads": h, "seq_len": n, "head_dim": d,
               "choice": sage_attn.dropin_backend(q, k, v)}
        times = measure(fns)
        row["sdpa_us"] = round(statistics.median(times["sdpa"]), 2)
        row["sageattn_us"] = round(statistics.median(times["sageattn"]), 2)
        us, *diff = (round(x, 2) for x in paired_summary(times, "dropin", "sdpa"))
        row.update(dropin_us=us, dropin_minus_sdpa_us=diff)
        us, *diff = (round(x, 2) for x in paired_summary(times, "alias", "sdpa"))
        row.update(alias_us=us, alias_minus_sdpa_us=diff)
        sage_attn.set_dropin_crossover(False)
        try:
            row["choice_crossover_off"] = sage_attn.dropin_backend(q, k, v)
            times = measure({"sdpa": fns["sdpa"], "dropin": fns["dropin"]})
        finally:
            sage_attn.set_dropin_crossover(True)
        us, *diff = (round(x, 2) for x in paired_summary(times, "dropin", "sdpa"))
        row.update(dropin_off_us=us, dropin_off_minus_sdpa_us=diff)
        rows.append(row)
        spread = lambda x: f"{x[0]:+.1f} [{x[1]:+.1f}, {x[2]:+.1f}]"  # noqa: E731
        print(f"| {call} | {b} | {h} | {n} | {d} | {row['sdpa_us']:.1f} | "
              f"{row['sageattn_us']:.1f} | {row['choice']} | {row['dropin_us']:.1f} | "
              f"{spread(row['dropin_minus_sdpa_us'])} | {row['dropin_off_us']:.1f} "
              f"({row['choice_crossover_off']}) | {spread(row['dropin_off_minus_sdpa_us'])} | "
              f"{spread(row['alias_minus_sdpa_us'])} |", flush=True)
    date = datetime.date.today().isoformat()
    meta = {"bench": "host-time", "gpu": gpu[0], "driver": gpu[1], "cuda": torch.version.cuda,
            "torch": torch.__version__, "commit": commit, "date": date, "dtype": "fp16",
            "rounds": args.host_rounds, "calls": args.host_calls,
            "fastpath": sage_attn._torch._fast is not None,
            "timing": "host µs per eager call, GPU held by a sleep, paired with SDPA by round"}
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (f"{date}-{gpu_slug(gpu[0])}" + (f"-{args.tag}" if args.tag else "")
                      + "-host.json")
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


class Impl:
    """What the bench runs for one row: `fn` (the timed call), `output()` (the result of the last
    call, for accuracy), the drop-in's choice, and a context every call of the row runs in (SDPA's
    backend choice: entered once, so that its cost is not in the host time); `graph_fn`, the call
    as the shape's shared graph timing captures it outside that context (fn by default)."""

    def __init__(self, fn, output=None, choice=None, kernel_only=False, context=None,
                 graph_fn=None):
        self.fn, self.kernel_only, self.choice = fn, kernel_only, choice
        self._output = output
        self.context = context if context is not None else contextlib.nullcontext()
        self.graph_fn = graph_fn if graph_fn is not None else fn

    def first_output(self):
        out = self.fn()
        return self._output() if self._output is not None else out


def dropin_choice(q, k, v, causal):
    """What sage_attn.scaled_dot_product_attention runs for these arguments ("sage" or "sdpa"),
    from the library's plan; None where the package has no dropin_backend."""
    backend = getattr(sage_attn, "dropin_backend", None)
    if backend is None:
        return None
    try:
        choice = backend(q, k, v, is_causal=causal, enable_gqa=False)
    except Exception as e:  # a report, not a reason to stop the bench
        print(f"sage_attn.dropin_backend failed ({type(e).__name__}: {e})", flush=True)
        return None
    return None if choice is None else str(choice)


def make_impl(impl, q, k, v, causal):
    """The Impl for one implementation name; raises when it cannot be set up."""
    if impl == "sage-8b":
        return Impl(lambda: sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=8))
    if impl == "sage-8b-mma":
        return Impl(lambda: sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=8, kernel="mma"))
    if impl == "sage-4b":
        return Impl(lambda: sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=4))
    if impl == "sdpa-dropin":
        # Top-left causal like SDPA (the same mask as the reference's here: Nq = Nk).
        return Impl(lambda: sage_attn.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    choice=dropin_choice(q, k, v, causal))
    if impl == "cudnn-fp8":
        anchor = CudnnFp8Attention(q, k, v, causal)
        return Impl(anchor, output=anchor.result, kernel_only=True)
    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[impl]

    def in_backend():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return Impl(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                context=sdpa_kernel(backend), graph_fn=in_backend)


def gpu_info():
    props = torch.cuda.get_device_properties(0)
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return props.name, driver


def _why(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _shape(d, n, causal):
    return f"D={d:<3d} N={n:<6d} {'causal    ' if causal else 'non-causal'}"


def measure(name, q, k, v, causal, ref, args):
    """(row, graph_fn): every figure that applies to `name` but the graph column, null where it
    does not or where a step failed (each failure printed on one line; the bench goes on), and
    the call for the shape's shared graph timing (graph_rows), None where the row did not run
    or is timed as a kernel alone."""
    b, h, n, d = q.shape
    row = new_row(name, d, n, b, h, causal)
    label = f"{name:11s} {_shape(d, n, causal)}"
    try:
        impl = make_impl(name, q, k, v, causal)
    except Exception as e:  # an impl that cannot be set up (or is missing): a null row
        print(f"{label}: not run ({_why(e)})", flush=True)
        return row, None
    try:
        with impl.context:
            row = _measure(impl, row, label, q, causal, ref, args)
    except Exception as e:  # a failure while timing: the figures so far, the rest null
        print(f"{label}: stopped ({_why(e)})", flush=True)
        return row, None
    ran = row["ms"] is not None and not impl.kernel_only
    return row, impl.graph_fn if ran else None


def graph_rows(rows_fns, q, causal, args):
    """The graph column of one shape's rows: the implementations that ran, their graphs timed
    in turn at a shared clock (interleaved_ms), so that the column compares them under the same
    conditions. (A row's capture that fails leaves its column null, with a line saying why.)"""
    b, h, n, d = q.shape
    fns = {row["impl"]: fn for row, fn in rows_fns if fn is not None}
    if not fns:
        return
    shape = _shape(d, n, causal)
    times = interleaved_ms(fns, args.seconds, 3,
                           lambda msg: print(f"graph {shape}: {msg}", flush=True))
    fl = flops(b, h, n, d, causal)
    for row, _ in rows_fns:
        ms = times.get(row["impl"])
        if ms is not None:
            row["graph_tops"] = tops(fl, ms)
    print(f"graph {shape}: " + "  ".join(
        f"{row['impl']} {row['graph_tops']:.1f}" for row, _ in rows_fns
        if row["graph_tops"] is not None) + " TOPS", flush=True)
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def _measure(impl, row, label, q, causal, ref, args):
    b, h, n, d = q.shape
    try:
        out = impl.first_output()
    except Exception as e:  # an impl that cannot run this shape: a null row
        print(f"{label}: not run ({_why(e)})", flush=True)
        return row
    row["choice"] = impl.choice
    if ref is not None and out is not None:
        row.update(accuracy(out[0, :ref.shape[0]], ref))
    del out
    fl = flops(b, h, n, d, causal)
    ms = time_ms(impl.fn, args.seconds)
    row["ms"] = round(ms, 4)
    if impl.kernel_only:
        row["kernel_tops"] = tops(fl, ms)
    else:
        row["e2e_tops"] = tops(fl, ms)
        if row["impl"].startswith("sage"):
            kms = kernel_ms(impl.fn)
            row["kernel_tops"] = tops(fl, kms)
        if not args.no_host:
            row["host_us"] = round(host_us(impl.fn, ms), 1)
    fmt = lambda x, f="{:7.1f}": "      -" if x is None else f.format(x)  # noqa: E731
    acc = (f" | cos {row['cos']:.5f} rel-L1 {row['rel_l1']:.4f} rmse {row['rmse']:.2e} "
           f"max {row['max_abs']:.3f}") if row["cos"] is not None else ""
    print(f"{label} {ms:9.3f} ms  eager {fmt(row['e2e_tops'])}  "
          f"kernel {fmt(row['kernel_tops'])} TOPS  host {fmt(row['host_us'])} us"
          + (f"  choice {row['choice']}" if row["choice"] else "") + acc, flush=True)
    return row


def main(argv=None):
    args = parse_args(argv, __doc__)
    if args.models:  # the attention calls of real models (image, video, LLM prefill, encoders)
        from . import bench_models
        return bench_models.main(["--out", args.out, "--seconds", str(args.seconds),
                                  "--commit", args.commit or "unknown"])
    if cuda_missing("sage_attn.bench", torch):
        return 2
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() or None
        except OSError:
            commit = None
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed if args.seed is not None else torch.seed() % 2**31)
    name, driver = gpu_info()
    if args.host_time:
        print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"sage {sage_attn.version()}, commit {commit}; host time per eager call; the "
              f"drop-in's C++ fast path {'on' if sage_attn._torch._fast else 'off'}",
              flush=True)
        return host_time(args, (name, driver), commit)
    b, h = args.batch, args.heads
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {cudnn_version}, "
          f"sage {sage_attn.version()}, commit {commit}; B={b} H={h}, {args.inputs} inputs",
          flush=True)
    rows = []
    for d in args.dims:
        for causal in args.causals:
            for n in args.seqs:
                q, k, v = make_inputs(b, h, n, d, args.inputs, gen)
                ref = None
                if args.accuracy_heads > 0:
                    ah = min(args.accuracy_heads, h)
                    ref = reference64(q[0, :ah], k[0, :ah], v[0, :ah], causal)
                shape_rows = []
                for impl in args.impls:
                    shape_rows.append(measure(impl, q, k, v, causal, ref, args))
                    torch.cuda.empty_cache()
                if not args.no_graph:
                    graph_rows(shape_rows, q, causal, args)
                rows.extend(row for row, _ in shape_rows)
                del q, k, v, ref
                torch.cuda.empty_cache()
    date = datetime.date.today().isoformat()
    stem = f"{date}-{gpu_slug(name)}" + (f"-{args.tag}" if args.tag else "")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": name, "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
            "cudnn": cudnn_version, "commit": commit, "date": date, "input": args.inputs}
    write_json(out_dir / f"{stem}.json", meta, rows)
    print(f"wrote {out_dir / (stem + '.json')}")
    if plot(rows, out_dir / f"{stem}.png", f"{name}, B={b} H={h}, {args.inputs} inputs, "
            f"commit {commit}"):
        print(f"wrote {out_dir / (stem + '.png')}")
    print()
    print(impl_table(rows))
    print()
    print(summary_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
