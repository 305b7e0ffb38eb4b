"""python -m sage_attn.bench_train: attention for training, forward + backward and backward alone,
sage (SageAttn2-8b forward, SageBwd backward) against torch's SDPA with the cuDNN and the flash
(FlashAttention-2) backends, in one process. B = 32768 / N (at least 1), H = 16 (--batch,
--heads), fp16 N(0,1) inputs, CUDA events, the median of repeated timings. TOPS count the forward as
4·N²·D·B·H (halved when causal) and the backward as 2.5x that. Writes JSON (and a PNG plot when
matplotlib is there) to --out.

    python -m sage_attn.bench_train --dims 64,128 --seqs 1024,2048,4096,8192,16384 --out bench/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys

import sage_attn

from ._bench_common import cuda_missing

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # --help and argument errors work without torch; main() says it is needed
    torch = None


def _time_ms(fn, seconds):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples, spent = [], 0.0
    while spent < seconds * 1000 or len(samples) < 3:
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        samples.append(ms)
        spent += ms
    return statistics.median(samples)


_IMPLS = ("sage", "sdpa-cudnn", "sdpa-flash")


def _impls():
    def sage(q, k, v, causal):
        return sage_attn.sageattn(q, k, v, is_causal=causal)

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    return {"sage": sage, "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--batch", type=int, default=0, help="0: 32768 tokens per head / N")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--impls", default="sage,sdpa-cudnn,sdpa-flash",
                    help="which of sage, sdpa-cudnn, sdpa-flash to time")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    chosen = a.impls.split(",")
    unknown = [x for x in chosen if x not in _IMPLS]
    if unknown:
        ap.error(f"--impls: unknown {', '.join(unknown)} (choose from {', '.join(_IMPLS)})")
    if cuda_missing("sage_attn.bench_train", torch):
        return 2
    dims = [int(x) for x in a.dims.split(",")]
    seqs = [int(x) for x in a.seqs.split(",")]
    causals = [bool(int(x)) for x in a.causal.split(",")]
    impls = {name: _impls()[name] for name in chosen}
    rows = []
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for d in dims:
        for causal in causals:
            for n in seqs:
                b = a.batch or max(1, 32768 // n)
                shape = (b, a.heads, n, d)
                q, k, v, do = (torch.randn(shape, generator=gen, device="cuda",
                                           dtype=torch.float16) for _ in range(4))
                fwd_flops = 4.0 * b * a.heads * n * n * d * (0.5 if causal else 1.0)
                for name, fn in impls.items():
                    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                    try:
                        def fwd_bwd():
                            o = fn(qq, kk, vv, causal)
                            o.backward(do)

                        ms_fb = _time_ms(fwd_bwd, a.seconds)
                        o = fn(qq, kk, vv, causal)

                        def bwd():
                            torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)

                        ms_b = _time_ms(bwd, a.seconds)
                    except RuntimeError as e:  # a backend that has no kernel for the shape
                        print(f"{name} D={d} N={n} causal={causal}: {str(e).splitlines()[0]}")
                        continue
                    row = {"impl": name, "head_dim": d, "seq_len": n, "batch": b,
                           "heads": a.heads, "causal": causal,
                           "fwd_bwd_tops": 3.5 * fwd_flops / ms_fb / 1e9,
                           "bwd_tops": 2.5 * fwd_flops / ms_b / 1e9,
                           "fwd_bwd_ms": ms_fb, "bwd_ms": ms_b}
                    rows.append(row)
                    print(f"D={d} causal={int(causal)} N={n:6d} {name:11s} fwd+bwd "
                          f"{row['fwd_bwd_tops']:6.1f} TOPS  bwd {row['bwd_tops']:6.1f} TOPS",
                          flush=True)
                    del qq, kk, vv, o
    _summary(rows)
    if a.out:
        gpu = torch.cuda.get_device_name().replace(" ", "-").lower()
        path = pathlib.Path(a.out) / f"{datetime.date.today()}-{gpu.split('-')[1] if '-' in gpu else gpu}-train.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "commit": a.commit, "date": str(datetime.date.today())}
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print("wrote", path)
        _plot(rows, path.with_suffix(".png"))


def _summary(rows):
    print("\n| D | causal | N | sage fwd+bwd | flash fwd+bwd | cuDNN fwd+bwd | sage/flash | "
          "sage/cuDNN | sage bwd | flash bwd | cuDNN bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["head_dim"], r["causal"], r["seq_len"]) for r in rows})
    for d, c, n in keys:
        get = {r["impl"]: r for r in rows if (r["head_dim"], r["causal"], r["seq_len"]) == (d, c, n)}
        s, f, u = get.get("sage"), get.get("sdpa-flash"), get.get("sdpa-cudnn")
        fmt = lambda r, key: f"{r[key]:.0f}" if r else "-"  # noqa: E731
        ratio = lambda x, y: f"{x['fwd_bwd_tops'] / y['fwd_bwd_tops']:.2f}" if x and y else "-"  # noqa: E731
        print(f"| {d} | {'yes' if c else 'no'} | {n} | {fmt(s, 'fwd_bwd_tops')} | "
              f"{fmt(f, 'fwd_bwd_tops')} | {fmt(u, 'fwd_bwd_tops')} | {ratio(s, f)} | "
              f"{ratio(s, u)} | {fmt(s, 'bwd_tops')} | {fmt(f, 'bwd_tops')} | {fmt(u, 'bwd_tops')} |")


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, (d, c) in zip(axes[0], keys):
        for impl in ("sage", "sdpa-flash", "sdpa-cudnn"):
            pts = sorted((r["seq_len"], r["fwd_bwd_tops"]) for r in rows
                         if r["impl"] == impl and r["head_dim"] == d and r["causal"] == c)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"fwd+bwd, D={d}, {'causal' if c else 'non-causal'}")
        ax.set_xlabel("N")
        ax.set_ylabel("TOPS")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
