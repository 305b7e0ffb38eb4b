"""python -m sage_attn.bench: the standard grid of BENCHMARKS.md with the baselines in the same
process. For every (head_dim, N, causal): end-to-end TOPS of sage (fp16 in, fp16 out: pre-pass and
kernel, timed with CUDA events, median of samples), kernel-only TOPS (the attention kernel's own
duration read with torch.profiler/CUPTI), SDPA cuDNN and SDPA flash, and accuracy (cos, rel-L1,
RMSE, max-abs) of every implementation against float64 on the first heads. Writes
<out>/<date>-<gpu>[-tag].json (the schema of BENCHMARKS.md) and a PNG plot (TOPS vs N per head dim
and mask, the paper's Fig. 5)."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sage_attn

# sage-8b is what the library picks (the wgmma kernel on sm_90); sage-8b-mma forces the mma.sync
# kernel (SAGE_KERNEL=mma) for comparison.
IMPLS = ("sage-8b", "sage-8b-mma", "sage-4b", "sdpa-cudnn", "sdpa-flash")


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
    return one(4.0), one(8.0), one(8.0)  # q, k, v (BENCHMARKS.md's channel-bias inputs)


def impl_fn(impl, q, k, v, causal):
    if impl == "sage-8b":
        return lambda: sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=8)
    if impl == "sage-8b-mma":
        def run_mma():
            os.environ["SAGE_KERNEL"] = "mma"
            try:
                return sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=8)
            finally:
                del os.environ["SAGE_KERNEL"]
        return run_mma
    if impl == "sage-4b":
        return lambda: sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=4)
    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[impl]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def gpu_info():
    props = torch.cuda.get_device_properties(0)
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return props.name, driver


def plot(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    dims = sorted({r["head_dim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(len(dims), len(causals), figsize=(6 * len(causals), 4.2 * len(dims)),
                             squeeze=False)
    for i, d in enumerate(dims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for impl in IMPLS:
                pts = sorted((r["seq_len"], r["e2e_tops"], r["kernel_tops"]) for r in rows
                             if r["impl"] == impl and r["head_dim"] == d and r["causal"] == causal
                             and r["e2e_tops"] is not None)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                line, = ax.plot(xs, [p[1] for p in pts], marker="o", label=impl)
                if any(p[2] for p in pts):
                    ax.plot(xs, [p[2] for p in pts], ls="--", color=line.get_color(),
                            label=f"{impl} kernel-only")
            ax.set_xscale("log", base=2)
            ax.set_xticks([1024 * 2**e for e in range(6)], ["1k", "2k", "4k", "8k", "16k", "32k"])
            ax.set_ylim(bottom=0)
            ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TOPS")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sage_attn.bench", description=__doc__)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON and the PNG")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--causal", default="both", choices=["both", "0", "1"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--impls", default="sage-8b,sdpa-cudnn,sdpa-flash",
                    help="comma list of " + ",".join(IMPLS))
    ap.add_argument("--inputs", default="normal", choices=["normal", "bias"])
    ap.add_argument("--accuracy-heads", type=int, default=8,
                    help="heads of batch 0 checked against float64 (0: no accuracy columns)")
    ap.add_argument("--seconds", type=float, default=0.25, help="timed seconds per figure")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    impls = args.impls.split(",")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"--impls: unknown implementation {i!r} (known: {', '.join(IMPLS)})")
    dims = [int(x) for x in args.dims.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    causals = {"both": [False, True], "0": [False], "1": [True]}[args.causal]
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
    b, h = args.batch, args.heads
    rows = []
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, sage {sage_attn.version()}, "
          f"commit {commit}; B={b} H={h}, {args.inputs} inputs", flush=True)
    for d in dims:
        for causal in causals:
            for n in seqs:
                q, k, v = make_inputs(b, h, n, d, args.inputs, gen)
                flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                ref = None
                if args.accuracy_heads > 0:
                    ah = min(args.accuracy_heads, h)
                    ref = reference64(q[0, :ah], k[0, :ah], v[0, :ah], causal)
                for impl in impls:
                    fn = impl_fn(impl, q, k, v, causal)
                    try:
                        out = fn()
                    except Exception as e:  # an impl that cannot run this shape: a null row
                        print(f"{impl:10s} D={d:<3d} N={n:<6d} {'causal' if causal else 'non-causal'}:"
                              f" not run ({type(e).__name__}: {e})", flush=True)
                        out = None
                    row = {"impl": impl, "head_dim": d, "seq_len": n, "batch": b, "heads": h,
                           "causal": causal, "e2e_tops": None, "kernel_tops": None, "ms": None,
                           "cos": None, "rel_l1": None, "rmse": None, "max_abs": None}
                    if out is not None:
                        if ref is not None:
                            row.update(accuracy(out[0, :ref.shape[0]], ref))
                        del out
                        ms = time_ms(fn, args.seconds)
                        row["ms"] = round(ms, 4)
                        row["e2e_tops"] = round(flops / ms / 1e9, 2)
                        if impl.startswith("sage"):
                            kms = kernel_ms(fn)
                            row["kernel_tops"] = round(flops / kms / 1e9, 2) if kms else None
                    rows.append(row)
                    if row["ms"] is not None:
                        kt = f"{row['kernel_tops']:7.1f}" if row["kernel_tops"] else "      -"
                        acc = (f" | cos {row['cos']:.5f} rel-L1 {row['rel_l1']:.4f} rmse "
                               f"{row['rmse']:.2e} max {row['max_abs']:.3f}") if row["cos"] is not None else ""
                        print(f"{impl:10s} D={d:<3d} N={n:<6d} {'causal    ' if causal else 'non-causal'}"
                              f" {ms:9.3f} ms  e2e {row['e2e_tops']:7.1f} TOPS  kernel {kt}{acc}",
                              flush=True)
                del q, k, v, ref
                torch.cuda.empty_cache()
    date = datetime.date.today().isoformat()
    gpu_slug = name.lower().replace("nvidia ", "").split()[0]
    stem = f"{date}-{gpu_slug}" + (f"-{args.tag}" if args.tag else "")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": name, "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
           "commit": commit, "date": date, "input": args.inputs, "rows": rows}
    with open(out_dir / f"{stem}.json", "w") as f:
        f.write("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items()
                                if k != "rows"))
        f.write(', "rows": [\n' + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]}\n")
    print(f"wrote {out_dir / (stem + '.json')}")
    if plot(rows, out_dir / f"{stem}.png", f"{name}, B={b} H={h}, {args.inputs} inputs, "
            f"commit {commit}"):
        print(f"wrote {out_dir / (stem + '.png')}")
    print()
    print(markdown_table(rows))
    return 0


def markdown_table(rows):
    """One line per (D, causal, N): e2e TOPS of each impl (kernel-only in brackets) and rel-L1."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    head = "| D | causal | N | " + " | ".join(impls) + " | " + " | ".join(f"{i} rel-L1" for i in impls) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(impls))]
    keys = sorted({(r["head_dim"], r["causal"], r["seq_len"]) for r in rows})
    for d, c, n in keys:
        cells, accs = [], []
        for i in impls:
            r = next((r for r in rows if (r["impl"], r["head_dim"], r["causal"], r["seq_len"]) ==
                      (i, d, c, n)), None)
            if r is None or r["e2e_tops"] is None:
                cells.append("-")
                accs.append("-")
                continue
            cells.append(f"{r['e2e_tops']:.0f}" + (f" ({r['kernel_tops']:.0f})" if r["kernel_tops"] else ""))
            accs.append(f"{r['rel_l1']:.4f}" if r["rel_l1"] is not None else "-")
        lines.append(f"| {d} | {'yes' if c else 'no'} | {n // 1024}k | " + " | ".join(cells) +
                     " | " + " | ".join(accs) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
