"""python -m sage_attn.bench_parallel: context parallelism on the GPUs of one host (NCCL).

For each sequence length N and mask: one GPU running the whole problem (sageattn, and torch's
SDPA flash) against Ulysses and ring attention over W GPUs with sage, then SDPA, as the local
kernel. Per row: milliseconds per call (CUDA events, median of samples, the slowest rank),
throughput of the whole problem (TOPS, 4·B·H·N²·D, half for causal, over the wall time of all
GPUs), speedup over one GPU with the same kernel, and the communication: the same scheme with the
local kernel replaced by nothing (an empty output, LSE 0) times the all-to-alls or the ring's
send/recv plus the layout copies and LSE merges around them (comm_ms); comm_share =
comm_ms / ms. The ring overlaps its transfers with compute, so for it comm_share bounds the
exposed share from above. Before the timing, each distributed output is checked against the
one-GPU SDPA output (cos, rel-L1). Writes JSON (--out) and prints a table.

    torchrun-free: python -m sage_attn.bench_parallel --gpus 2 --out par.json
NCCL_NVLS_ENABLE=0 (NVLink multicast off) is set unless the environment sets it."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except ImportError:  # --help works without torch; main() says it is needed
    torch = None

SCHEMES = ("ulysses", "ring")
LOCALS = ("sage", "sdpa")


def build_parser():
    p = argparse.ArgumentParser(prog="python -m sage_attn.bench_parallel",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--gpus", type=int, default=2, help="GPUs (processes) for the schemes (2)")
    p.add_argument("--seq", default="32768,65536,98304,131072",
                   help="comma-separated sequence lengths N (whole problem; 32k..128k)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=24, help="query heads (24, as video DiTs)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (= --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    p.add_argument("--mask", choices=("none", "causal", "both"), default="both")
    p.add_argument("--samples", type=int, default=5, help="timed samples per row (median)")
    p.add_argument("--target-s", type=float, default=1.0, help="seconds of calls per row")
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    return p


def _flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def _nothing(q, k, v, tensor_layout, is_causal, sm_scale):
    # The local kernel replaced by nothing: what is left is the communication and the layout
    # copies and merges around it.
    hi, ni = (1, 2) if tensor_layout == "HND" else (2, 1)
    lse = torch.zeros((q.shape[0], q.shape[hi], q.shape[ni]), dtype=torch.float32,
                      device=q.device)
    return torch.empty_like(q), lse


def _time_ms(fn, target_s, samples):
    """Median per-call ms over samples on this rank, then the slowest rank's (all ranks run)."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = torch.tensor([max(start.elapsed_time(end), 1e-3)], device="cuda")
    dist.all_reduce(once, op=dist.ReduceOp.MAX)  # (every rank runs the same count)
    iters = max(1, min(100, int(target_s * 1e3 / samples / once.item())))
    times = []
    for _ in range(samples):
        dist.barrier()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_single(fn, rank, target_s, samples):
    """One GPU's time (rank 0 runs, the others wait), broadcast to every rank."""
    from .bench import time_ms  # the one-GPU benchmark's timer

    t = torch.zeros(1, device="cuda")
    if rank == 0:
        t.fill_(time_ms(fn, target_s, samples))
    dist.broadcast(t, 0)
    return t.item()


def _accuracy(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    d = o - r
    return {"cos": float((o @ r) / (o.norm() * r.norm()).clamp_min(1e-300)),
            "rel_l1": float(d.abs().sum() / r.abs().sum().clamp_min(1e-300))}


def _run(rank, world, port, args, result_path):
    from . import parallel
    from ._torch import sageattn

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        b, h, d = args.batch, args.heads, args.head_dim
        hkv = args.kv_heads or h
        masks = {"none": (False,), "causal": (True,), "both": (False, True)}[args.mask]
        rows = []
        for n in (int(x) for x in args.seq.split(",")):
            if n % (2 * world):
                raise SystemExit(f"--seq: N = {n} must divide by 2 * gpus = {2 * world}")
            g = torch.Generator(device="cuda").manual_seed(n)
            q = torch.randn((b, h, n, d), generator=g, device="cuda", dtype=dtype)
            k = torch.randn((b, hkv, n, d), generator=g, device="cuda", dtype=dtype)
            v = torch.randn((b, hkv, n, d), generator=g, device="cuda", dtype=dtype)
            for causal in masks:
                flop = _flops(b, h, n, d, causal)
                common = {"N": n, "causal": causal, "batch": b, "heads": h, "kv_heads": hkv,
                          "head_dim": d, "gpus": world}
                gqa = hkv != h

                def sdpa_whole():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          enable_gqa=gqa)
                ref = sdpa_whole() if rank == 0 else None
                single = {}
                for name, fn in (("sage", lambda: sageattn(q, k, v, is_causal=causal)),
                                 ("sdpa", sdpa_whole)):
                    ms = _time_single(fn, rank, args.target_s, args.samples)
                    single[name] = ms
                    rows.append({**common, "impl": f"1gpu-{name}", "gpus": 1, "ms": ms,
                                 "tops": flop / ms / 1e9})
                for scheme in SCHEMES:
                    fn_scheme = (parallel.ulysses_attention if scheme == "ulysses"
                                 else parallel.ring_attention)
                    if scheme == "ring" and causal:
                        qs, ks, vs = (parallel.zigzag_shard(x, rank, world) for x in (q, k, v))
                    else:
                        qs, ks, vs = (x.chunk(world, dim=2)[rank].contiguous()
                                      for x in (q, k, v))
                    if scheme == "ulysses" and (h % world or hkv % world):
                        continue
                    comm_ms = _time_ms(lambda: fn_scheme(qs, ks, vs, is_causal=causal,
                                                         local=_nothing, check_shapes=False),
                                       args.target_s, args.samples)
                    for local in LOCALS:
                        def call(check=False):
                            return fn_scheme(qs, ks, vs, is_causal=causal, local=local,
                                             check_shapes=check)
                        o = call(check=True)  # the check before the timing
                        parts = [torch.empty_like(o) for _ in range(world)]
                        dist.all_gather(parts, o.contiguous())
                        acc = None
                        if rank == 0:
                            whole = (parallel.zigzag_unshard(parts) if scheme == "ring" and
                                     causal else torch.cat(parts, dim=2))
                            acc = _accuracy(whole, ref)
                        del parts, o
                        ms = _time_ms(call, args.target_s, args.samples)
                        row = {**common, "impl": f"{scheme}-{local}", "ms": ms,
                               "tops": flop / ms / 1e9, "speedup_vs_1gpu": single[local] / ms,
                               "comm_ms": comm_ms, "comm_share": min(1.0, comm_ms / ms)}
                        if acc is not None:
                            row.update(acc)
                        rows.append(row)
                del ref
            del q, k, v
            torch.cuda.empty_cache()
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def _table(rows):
    head = (f"{'N':>7} {'mask':>6} {'impl':>13} {'ms':>9} {'TOPS':>7} {'x 1gpu':>7} "
            f"{'comm ms':>8} {'comm %':>6} {'cos':>8} {'rel_l1':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['N']:>7} {'causal' if r['causal'] else 'none':>6} {r['impl']:>13} "
                     f"{r['ms']:>9.2f} {r['tops']:>7.0f} "
                     f"{r.get('speedup_vs_1gpu', float('nan')):>7.2f} "
                     f"{r.get('comm_ms', float('nan')):>8.2f} "
                     f"{100 * r.get('comm_share', float('nan')):>6.1f} "
                     f"{r.get('cos', float('nan')):>8.5f} {r.get('rel_l1', float('nan')):>7.4f}")
    return "\n".join(lines)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if torch is None:
        raise SystemExit("sage_attn.bench_parallel needs PyTorch with CUDA")
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                         "CUDA GPUs")
    if args.gpus < 2:
        raise SystemExit(f"--gpus {args.gpus}: needs at least 2")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (KINDS.md)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        torch.multiprocessing.spawn(_run, args=(args.gpus, port, args, path), nprocs=args.gpus,
                                    join=True)
        with open(path) as f:
            rows = json.load(f)
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "dtype": args.dtype,
            "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
            "comm_ms": "the scheme with the local kernel replaced by nothing",
            "tops": "4*B*H*N^2*D (half for causal) over the wall time of all GPUs together"}
    print(_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
