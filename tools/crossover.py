"""tools/crossover.py: the measurements behind the SDPA drop-in's crossover model, and its fit.

    python tools/crossover.py sweep --out bench/results          # on a GPU: about 3 min
    python tools/crossover.py fit bench/results/*-crossover.json --emit src/api/crossover_model.inc

`sweep` times sage (SageAttn2-8b, sage_attn.sageattn) and torch's SDPA with the cuDNN backend
(the faster of torch's on Hopper at every shape measured) on a grid of (B·H, N, D, mask, GQA
group) under CUDA-graph replay (GPU time alone: the figure the "never slower" rule reads; the two
graphs replayed in turn over --rounds rounds, median), fp16 N(0,1) inputs, B = 1. It writes <out>/<date>-<gpu>-crossover.json.

`fit` fits, for each (kernel head dim, mask), one cost model per implementation by least squares
on relative error (every coefficient non-negative: a feature that would take a negative one is
dropped). The features are what each kernel pays for:
  sage   1 (the launches), B·Hkv·Nk·Dk (the K/V pre-pass reads and writes K and V),
         B·Hq·Nq·Dk (Q's quantization and O's store), and waves·keys·Dk: the persistent
         kernel's critical path, ceil(tiles / SMs) query tiles of block_q rows each over the keys a
         tile visits (all Nk, or on average half of them under a causal mask);
  cuDNN  1, B·Hq·Nq·Nk'·D (the matmuls; Nk' the keys visited), and the same wave term with
         128-row tiles at the call's own head dim D.
The drop-in sends a call to sage where predicted t_sage·(1 + margin) < t_cudnn, the margin
chosen as the least that routes no measured point where sage was more than 2 % slower (and at
least 3 %). `--emit` writes the coefficients and margins as a C++ table for src/api/plan.cpp.
The fit also prints every point the model gets wrong either way.

An experiment of the repository (like tools/train_parity.py), not a module of the package."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The kernel head dims and the padded head dims each runs (plan.cpp: gpu_kernel_head_dim).
KERNEL_DIMS = (64, 128, 256)


def kernel_dim(d):
    return next(k for k in KERNEL_DIMS if d <= k)


def sage_block_q(dk, causal, nq):
    # plan.cpp: sm90_consumers (a 16-byte aligned Q: quantized in the kernel) times 64 rows.
    return 64 * (3 if dk == 64 and not (causal and nq <= 4096) else 2)


def features(impl, hq, hkv, nq, nk, d, causal, sms, batch=1):
    """The cost model's features of one call (units: giga-elements, so coefficients are about
    milliseconds per unit). Both implementations compute at a kernel head dim: cuDNN, too, pads
    a head dim to the next of 64, 128, 256 (measured: D 72-96 cost what D 128 does)."""
    dk = kernel_dim(d)
    visit = 0.5 if causal else 1.0  # the share of keys a query tile visits on average
    bq = sage_block_q(dk, causal, nq) if impl == "sage" else 128
    tiles = batch * hq * math.ceil(nq / bq)
    waves = math.ceil(tiles / sms)
    work = batch * hq * nq * nk * visit * dk * 1e-12  # the matmuls (tera multiply-adds / 2)
    # The critical path: whole waves of equal tiles; under a causal mask the tiles differ (the
    # last visits all Nk keys), and the longest one bounds it where the tiles are few.
    if causal:
        tail = max(bq * nk, tiles * bq * nk * visit / sms) * dk * 1e-9
    else:
        tail = waves * bq * nk * dk * 1e-9
    # Lengths that are not multiples of 128 (a model's 4096 image + 333 text tokens): cuDNN
    # measured 10-20 % slower there than its aligned neighbours predict.
    ragged = work if nq % 128 or nk % 128 else 0.0
    if impl == "sage":
        return [1.0, batch * hkv * nk * dk * 1e-9, batch * hq * nq * dk * 1e-9, work, tail, ragged]
    return [1.0, batch * hq * nq * dk * 1e-9, work, tail, ragged]


# ----------------------------------------------------------------------------------------------
# sweep (GPU)


def sweep(argv):
    ap = argparse.ArgumentParser(prog="tools/crossover.py sweep")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--padded-dims", default="40,72,80,96",
                    help="head dims zero-padded to a kernel's, on a smaller grid")
    ap.add_argument("--heads", default="4,8,12,16,24,32,48,64,96,128", help="B·H (B = 1)")
    ap.add_argument("--seqs", default="512,1024,1536,2048,3072,4096,4608,5120,6144,7168,8192,"
                                      "12288,16384")
    ap.add_argument("--groups", default="1,4", help="GQA groups (Hq / Hkv), at --group-dims")
    ap.add_argument("--group-dims", default="128",
                    help="head dims swept at every GQA group (the others at group 1 only)")
    ap.add_argument("--seconds", type=float, default=0.04, help="timing target per figure")
    ap.add_argument("--max-ms", type=float, default=40.0, help="skip shapes slower than this")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds sage's and cuDNN's graphs are replayed in turn (median)")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "python"))
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sage_attn
    from sage_attn._bench_common import gpu_slug
    from sage_attn.bench import gpu_info, interleaved_ms

    def ints(s):
        return [int(x) for x in s.split(",") if x]

    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = []
    for d in ints(a.dims):
        for causal in (False, True):
            for g in (ints(a.groups) if d in ints(a.group_dims) else [1]):
                for h in ints(a.heads):
                    if h % g == 0:
                        shapes += [(h, h // g, n, d, causal) for n in ints(a.seqs)]
    for d in ints(a.padded_dims):
        for h in (8, 16, 32, 64):
            shapes += [(h, h, n, d, False) for n in (1024, 2048, 4096, 8192)]
    rows = []
    for i, (hq, hkv, n, d, causal) in enumerate(shapes):
        est = 4.0 * hq * n * n * d / (2 if causal else 1) / 400e12 * 1e3  # ms at 400 TFLOPS
        if est > a.max_ms:
            continue
        q = torch.randn((1, hq, n, d), generator=gen, device="cuda", dtype=torch.float16)
        k = torch.randn((1, hkv, n, d), generator=gen, device="cuda", dtype=torch.float16)
        v = torch.randn((1, hkv, n, d), generator=gen, device="cuda", dtype=torch.float16)
        kk = k.repeat_interleave(hq // hkv, 1) if hq != hkv else k
        vv = v.repeat_interleave(hq // hkv, 1) if hq != hkv else v

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal)

        row = {"heads_q": hq, "heads_kv": hkv, "seq_q": n, "seq_k": n, "head_dim": d,
               "causal": causal, "batch": 1}
        times = interleaved_ms({"sage": lambda: sage_attn.sageattn(q, k, v, is_causal=causal),
                                "cudnn": cudnn}, a.seconds, a.rounds,
                               lambda msg: print(f"{row}: {msg}", flush=True))
        row.update({name + "_ms": ms for name, ms in times.items()})
        rows.append(row)
        if i % 20 == 0 or n >= 8192 and hq >= 96:
            print(f"[{i + 1}/{len(shapes)}] H={hq}/{hkv} N={n} D={d} causal={causal}: sage "
                  f"{row['sage_ms']} ms, cudnn {row['cudnn_ms']} ms", flush=True)
        del q, k, v, kk, vv
    name, driver = gpu_info()
    meta = {"bench": "crossover", "gpu": name, "driver": driver, "sms": props.multi_processor_count,
            "mem_bus_bits": props.memory_bus_width,
            "cc": f"{props.major}{props.minor}", "torch": torch.__version__, "commit": a.commit,
            "date": datetime.date.today().isoformat(), "dtype": "fp16",
            "timing": "CUDA-graph replay, median", "sage_version": sage_attn.version()}
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date']}-{gpu_slug(name)}-crossover.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print("wrote", path, f"({len(rows)} shapes)")
    return 0


# ----------------------------------------------------------------------------------------------
# fit (CPU)


def nnls_rel(x, t):
    """Least squares of x·c ≈ t on relative error (rows scaled by 1/t), every coefficient >= 0:
    the most negative one's feature is dropped and the rest refitted until none is."""
    import numpy as np
    x = np.asarray(x, float)
    t = np.asarray(t, float)
    keep = list(range(x.shape[1]))
    while True:
        w = x[:, keep] / t[:, None]
        c, *_ = np.linalg.lstsq(w, np.ones(len(t)), rcond=None)
        if (c >= 0).all():
            full = np.zeros(x.shape[1])
            full[keep] = c
            return full
        keep.pop(int(np.argmin(c)))


def predict(coef, feats):
    return sum(c * f for c, f in zip(coef, feats))


def fit(argv):
    ap = argparse.ArgumentParser(prog="tools/crossover.py fit")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--emit", default=None, help="write the C++ table here")
    ap.add_argument("--emit-points", default=None,
                    help="write every pooled measured point and the fit's choice (the C++ tests)")
    ap.add_argument("--slower", type=float, default=0.02,
                    help="the loss the rule tolerates on a measured point (0.02: 2 %%)")
    ap.add_argument("--min-margin", type=float, default=0.03)
    a = ap.parse_args(argv)
    # Every sweep of one GPU (cc, SMs, memory bus width) pooled; a shape measured more than once
    # gets the geometric mean of its times (run-to-run spread: about ±6 % at the 5th/95th
    # percentile of the sage/cuDNN ratio on an H100, mostly at the smallest shapes).
    same = {}
    metas = []
    for f in a.files:
        doc = json.loads(pathlib.Path(f).read_text())
        metas.append({k: doc[k] for k in ("gpu", "sms", "cc", "mem_bus_bits", "commit", "date")})
        for r in doc["rows"]:
            if r.get("sage_ms") and r.get("cudnn_ms"):
                r = dict(r, sms=doc["sms"], cc=int(doc["cc"]), bus=doc["mem_bus_bits"])
                key = tuple(r[k] for k in ("cc", "sms", "bus", "batch", "heads_q", "heads_kv",
                                           "seq_q", "seq_k", "head_dim", "causal"))
                same.setdefault(key, []).append(r)
    groups = {}
    for rs in same.values():
        r = dict(rs[0])
        for t in ("sage_ms", "cudnn_ms"):
            r[t] = math.exp(sum(math.log(x[t]) for x in rs) / len(rs))
        groups.setdefault((r["cc"], r["sms"], r["bus"], kernel_dim(r["head_dim"]), r["causal"]),
                          []).append(r)
    table, points = [], []
    for (cc, sms, bus, dk, causal), rows in sorted(groups.items()):
        def feats(impl, r):
            return features(impl, r["heads_q"], r["heads_kv"], r["seq_q"], r["seq_k"],
                            r["head_dim"], r["causal"], r["sms"], r.get("batch", 1))
        cs = nnls_rel([feats("sage", r) for r in rows], [r["sage_ms"] for r in rows])
        cc_ = nnls_rel([feats("cudnn", r) for r in rows], [r["cudnn_ms"] for r in rows])
        pred = []
        for r in rows:
            r["block_q"] = sage_block_q(dk, r["causal"], r["seq_q"])
            ps, pc = predict(cs, feats("sage", r)), predict(cc_, feats("cudnn", r))
            pred.append((pc / ps, r["cudnn_ms"] / r["sage_ms"], r))
        err_s = max(abs(predict(cs, feats("sage", r)) / r["sage_ms"] - 1) for r in rows)
        err_c = max(abs(predict(cc_, feats("cudnn", r)) / r["cudnn_ms"] - 1) for r in rows)
        # The least margin (from min_margin up) that routes no point measured more than
        # `slower` slower: sage iff predicted ratio > 1 + margin.
        bad = [p for p, m, _ in pred if m < 1 - a.slower]
        margin = max([a.min_margin] + [p - 1 + 1e-4 for p in bad])
        routed = [(p, m, r) for p, m, r in pred if p > 1 + margin]
        wins = [(p, m, r) for p, m, r in pred if m > 1.0]
        slow = [(p, m, r) for p, m, r in routed if m < 1.0]
        missed = [(p, m, r) for p, m, r in wins if p <= 1 + margin]
        print(f"\ncc {cc}, {sms} SMs, {bus}-bit memory; Dk {dk} {'causal' if causal else 'no mask'}: {len(rows)} points; "
              f"max rel. error sage {err_s:.1%}, cuDNN {err_c:.1%}; margin {margin:.3f}; "
              f"routed to sage {len(routed)}, sage faster at {len(wins)} "
              f"(missed {len(missed)}), routed and slower {len(slow)}")
        print(f"  sage ms = {' + '.join(f'{c:.4g}' for c in cs)} · features; "
              f"cuDNN ms = {' + '.join(f'{c:.4g}' for c in cc_)} · features")
        for p, m, r in sorted(slow, key=lambda x: x[1]):
            print(f"  routed, slower: H {r['heads_q']}/{r['heads_kv']} N {r['seq_q']} "
                  f"D {r['head_dim']} measured {m:.3f}x predicted {p:.3f}x")
        for p, m, r in sorted(missed, key=lambda x: -x[1])[:12]:
            print(f"  missed win: H {r['heads_q']}/{r['heads_kv']} N {r['seq_q']} "
                  f"D {r['head_dim']} measured {m:.3f}x predicted {p:.3f}x")
        # Outside the grid's lengths nothing was measured: a call whose queries or keys are fewer
        # than the least length routed here stays with SDPA (cross-attention to 77 text tokens,
        # decoding).
        min_seq = min((r["seq_q"] for _, _, r in routed), default=1 << 62)
        table.append((cc, sms, bus, dk, causal, list(cs), list(cc_), margin, min_seq))
        points += [(r, p, 1 + margin, p > 1 + margin and r["seq_q"] >= min_seq)
                   for p, _, r in pred]
    if a.emit:
        emit(pathlib.Path(a.emit), table, metas)
    if a.emit_points:
        emit_points(pathlib.Path(a.emit_points), points)
    return 0


def emit(path, table, metas):
    src = ", ".join(sorted({m["gpu"] for m in metas}))
    lines = [
        "// Generated by tools/crossover.py fit from bench/results/*-crossover*.json: do not edit.",
        f"// GPUs: {src}.",
        "// {cc, SMs, memory bus bits, kernel head dim, causal, sage coefficients[6], cuDNN",
        "//  coefficients[5], margin, least length}",
    ]
    for cc, sms, bus, dk, causal, cs, cc_, margin, min_seq in table:
        f = lambda xs: "{" + ", ".join(f"{x:.6g}" for x in xs) + "}"  # noqa: E731
        lines.append(f"{{{cc}, {sms}, {bus}, {dk}, {'true' if causal else 'false'}, {f(cs)}, {f(cc_)}, "
                     f"{margin:.4f}, {min_seq}}},")
    path.write_text("\n".join(lines) + "\n")
    print("wrote", path)


def emit_points(path, points):
    lines = [
        "// Generated by tools/crossover.py fit --emit-points: do not edit. Every measured point",
        "// behind src/api/crossover_model.inc (repeated sweeps: geometric mean times) and the",
        "// fit's choice.",
        "// {cc, SMs, bus bits, batch, Hq, Hkv, Nq, Nk, D, causal, block_q, sage ms, cuDNN ms,",
        "//  predicted cuDNN/sage ratio over (1 + margin), sage chosen}",
    ]
    for r, p, threshold, chosen in points:
        lines.append(
            f"{{{r['cc']}, {r['sms']}, {r['bus']}, {r.get('batch', 1)}, {r['heads_q']}, "
            f"{r['heads_kv']}, {r['seq_q']}, {r['seq_k']}, {r['head_dim']}, "
            f"{'true' if r['causal'] else 'false'}, {r['block_q']}, {r['sage_ms']:.6g}, "
            f"{r['cudnn_ms']:.6g}, {p / threshold:.6f}, {'true' if chosen else 'false'}}},")
    path.write_text("\n".join(lines) + "\n")
    print("wrote", path, f"({len(points)} points)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("sweep", "fit"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return (sweep if argv[0] == "sweep" else fit)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
