"""python -m sage_attn.bench_varlen: a packed batch of mixed lengths (issue 19's variable-length
bar) timed three ways in one process: one sageattn_varlen call, the same work as separate dense
sageattn calls (one per sequence, the library's AUTO family each), and torch's SDPA on the batch
padded to its longest sequence (a key padding mask, the memory-efficient backend or whichever
SDPA picks). Lengths are drawn uniformly from --min-len..--max-len (the same for queries and
keys, so causal is one alignment). fp16 N(0,1) inputs, CUDA events, the median of repeated
timings, CUDA-graph replay for the sage rows (eager figures beside); TOPS count the sum over
sequences of 4·Nq·Nk·D·H (halved when causal). Writes JSON to --out.

    python -m sage_attn.bench_varlen --seqs 64 --min-len 128 --max-len 8192 --out bench/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --help and argument errors work without torch; main() says it is needed
    torch = None


def _parser():
    p = argparse.ArgumentParser(prog="python -m sage_attn.bench_varlen",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=64, help="sequences in the batch (default 64)")
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16, help="query and key heads (default 16)")
    p.add_argument("--dims", default="128", help="head dims, comma-separated (default 128)")
    p.add_argument("--causal", default="0,1", help="0, 1 or 0,1 (default both)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and inputs")
    p.add_argument("--no-sdpa", action="store_true", help="skip the padded SDPA row")
    p.add_argument("--kernel", default=None, choices=["auto", "mma", "sm90"],
                   help="the packed call's kernel family (default: the library's choice)")
    p.add_argument("--out", default=None, help="directory for <date>-<gpu>-varlen.json")
    return p


def _flops(lens, heads, d, causal):
    return sum(4.0 * n * n * d * heads * (0.5 if causal else 1.0) for n in lens)


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.min_len < 1 or args.max_len < args.min_len or args.seqs < 1:
        print("bench_varlen: need 1 <= --min-len <= --max-len and --seqs >= 1", file=sys.stderr)
        return 2
    if torch is None or not torch.cuda.is_available():
        print("bench_varlen: needs torch with a CUDA device", file=sys.stderr)
        return 2
    import sage_attn
    from sage_attn.bench import graph_ms, time_ms

    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.seqs,), generator=gen).tolist()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32,
                      device="cuda")
    total, longest, H = sum(lens), max(lens), args.heads
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        gd = torch.Generator(device="cuda").manual_seed(args.seed + d)
        q, k, v = (torch.randn((total, H, d), generator=gd, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            flop = _flops(lens, H, d, causal)
            row = {"head_dim": d, "causal": causal, "seqs": args.seqs, "heads": H,
                   "total_tokens": total, "max_len": longest, "lens": lens}

            def packed():
                return sage_attn.sageattn_varlen(q, k, v, cu, cu, longest, longest,
                                                 is_causal=causal, kernel=args.kernel)

            starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
            views = [(q[None, a:b], k[None, a:b], v[None, a:b])
                     for a, b in zip(starts[:-1], starts[1:])]

            def dense():
                for qs, ks, vs in views:
                    sage_attn.sageattn(qs, ks, vs, tensor_layout="NHD", is_causal=causal)

            for name, fn in (("sage-varlen", packed), ("sage-dense-calls", dense)):
                eager = time_ms(fn)
                graph = graph_ms(fn, est_ms=eager)
                row[name] = {"ms": graph, "tops": flop / graph / 1e9, "eager_ms": eager,
                             "eager_tops": flop / eager / 1e9}
            if not args.no_sdpa:
                # The padded batch [B, H, longest, D] with a boolean mask of the real keys (and the
                # causal diagonal): the work SDPA does is B·longest², the TOPS count the real work.
                try:
                    qp, kp, vp = (torch.zeros((args.seqs, H, longest, d), device="cuda",
                                              dtype=torch.float16) for _ in range(3))
                    for b, (a, e) in enumerate(zip(starts[:-1], starts[1:])):
                        for src, dst in ((q, qp), (k, kp), (v, vp)):
                            dst[b, :, :e - a] = src[a:e].transpose(0, 1)
                    n = torch.arange(longest, device="cuda")
                    key_ok = n[None, :] < torch.tensor(lens, device="cuda")[:, None]
                    mask = key_ok[:, None, None, :]
                    if causal:
                        mask = mask & (n[None, :] <= n[:, None])[None, None]

                    def sdpa():
                        F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)

                    ms = time_ms(sdpa)
                    row["sdpa-padded"] = {"ms": ms, "tops": flop / ms / 1e9}
                    del qp, kp, vp, mask
                except torch.OutOfMemoryError as e:
                    row["sdpa-padded"] = {"ms": None, "tops": None, "error": str(e)[:200]}
            s, dc = row["sage-varlen"], row["sage-dense-calls"]
            row["varlen_over_dense"] = dc["ms"] / s["ms"]
            sd = row.get("sdpa-padded", {})
            print(f"D={d} causal={int(causal)} {args.seqs} seqs {args.min_len}..{args.max_len} "
                  f"(total {total}): varlen {s['ms']:.3f} ms {s['tops']:.0f} TOPS | dense calls "
                  f"{dc['ms']:.3f} ms {dc['tops']:.0f} TOPS | SDPA padded "
                  f"{sd.get('ms') or float('nan'):.3f} ms | dense/varlen "
                  f"{row['varlen_over_dense']:.2f}x")
            rows.append(row)
    if args.out:
        gpu = torch.cuda.get_device_name().replace(" ", "-").lower()
        path = pathlib.Path(args.out) / f"{datetime.date.today()}-{gpu}-varlen.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"bench": "varlen", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "args": vars(args)}
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
