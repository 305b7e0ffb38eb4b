"""python -m sage_attn.accuracy --q q.npy --k k.npy --v v.npy: how accurate sage is on your own
tensors. Loads .npy or .pt ([B,H,N,D], [H,N,D] or [N,D]; HND or NHD), rounds them to fp16 (bf16
with --dtype bf16) and prints cos / rel-L1 / RMSE / max-abs against float64 attention of those
rounded inputs for SageAttn2-8b and -4b (with and without each smoothing) and, on a GPU, SDPA
in the same dtype. Without a GPU the CPU reference's exact emulation of each kernel runs.
Then SageAttention3's Table 1 (its FP4 attention: MXFP4 against NVFP4, P~ quantized
directly or in two levels, beside fp16 and SageAttn2-8b), always on the CPU emulation: no GPU
here has FP4 kernels (--no-fp4 skips it; it is slow on long sequences).
Exit status 2, with one line naming the file, for an input it cannot use (missing, unreadable,
not floating point, empty, NaN/inf, values the dtype cannot hold); 1 when an output is not
finite."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

import sage_attn
from sage_attn import _lib


class InputError(Exception):
    """A file the tool cannot use as it is: printed as one line, exit status 2."""


# The largest finite value of each dtype the inputs are rounded to.
_MAX = {"fp16": 65504.0, "bf16": 3.3895313892515355e38}


def load(path):
    p = pathlib.Path(path)
    try:
        if p.suffix == ".npy":
            with open(p, "rb") as f:
                if f.read(6) != b"\x93NUMPY":
                    raise InputError(f"{path}: not a .npy file")
            x = np.load(p, allow_pickle=False)
        elif p.suffix in (".pt", ".pth"):
            import torch
            x = torch.load(p, map_location="cpu", weights_only=True)
            if not isinstance(x, torch.Tensor):
                raise InputError(f"{path}: expected one tensor, found {type(x).__name__}")
            x = x.float().numpy()
        else:
            raise InputError(f"{path}: expected a .npy or .pt file")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except InputError:
        raise
    except ImportError:
        raise InputError(f"{path}: reading .pt files needs PyTorch") from None
    except Exception as e:  # numpy's and torch's many ways to fail on a corrupt file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path}: cannot read it ({why})") from None
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        raise InputError(f"{path}: dtype {getattr(x, 'dtype', type(x).__name__)} is not a "
                         "floating-point type (need float16, float32 or float64)")
    if x.ndim not in (2, 3, 4):
        raise InputError(f"{path}: expected [B,H,N,D], [H,N,D] or [N,D], got shape {x.shape}")
    return x


def to_4d(x, layout):
    if x.ndim == 2:
        return x[None, None] if layout == "HND" else x[None, :, None]
    if x.ndim == 3:
        return x[None]
    return x


def check(x, path, layout, dtype):
    """An input the kernels could not take as it is: an empty axis, NaN or infinity, values
    beyond the range of the dtype it is rounded to."""
    for axis, size in zip("BHND" if layout == "HND" else "BNHD", x.shape):
        if size == 0:
            raise InputError(f"{path}: {axis} = 0: the tensor is empty")
    finite = np.isfinite(x)
    if not finite.all():
        raise InputError(f"{path}: {x.size - int(finite.sum())} of {x.size} values are NaN or "
                         "infinite")
    top = float(np.abs(x).max())
    if top > _MAX[dtype]:
        raise InputError(f"{path}: values up to {top:.3g} overflow {dtype} (max {_MAX[dtype]:.6g})")

def _fp4_configs():
    """SageAttention3's Table 1 as (label, QuantConfig): each FP4 row smooths Q and K (Algorithm 1),
    as `sage accuracy`'s table (src/ref/ablations.cpp)."""
    L = _lib
    fp16 = L.preset(L.VARIANT_EXACT)
    fp16.pv_format = L.PV_FP16
    rows = [("fp16 (P~, V in fp16, fp32 accumulator)", fp16),
            ("SageAttn2-8b", L.preset(L.VARIANT_SAGE2_8B))]
    for label, qk, pv, smooth_v in (
            ("MXFP4 Q·K only (P~, V in fp16)", L.QK_MXFP4, L.PV_FP16, False),
            ("NVFP4 Q·K only (P~, V in fp16)", L.QK_NVFP4, L.PV_FP16, False),
            ("MXFP4 (E8M0 scale / 32), P~ direct", L.QK_MXFP4, L.PV_MXFP4, False),
            ("NVFP4 (E4M3 scale / 16), P~ direct", L.QK_NVFP4, L.PV_NVFP4_DIRECT, False),
            ("NVFP4, P~ two-level (SageAttn3)", L.QK_NVFP4, L.PV_NVFP4, False),
            ("NVFP4, P~ two-level + smooth V", L.QK_NVFP4, L.PV_NVFP4, True)):
        cfg = L.preset(L.VARIANT_SAGE3_FP4)
        cfg.qk_format, cfg.pv_format = qk, pv
        if smooth_v:
            cfg.smooth |= L.SMOOTH_V
        rows.append((label, cfg))
    return rows


CONFIGS = [  # label, sageattn keywords
    ("SageAttn2-8b", {"qk_bits": 8}),
    ("SageAttn2-8b, no smooth V", {"qk_bits": 8, "smooth_v": False}),
    ("SageAttn2-8b, no smoothing", {"qk_bits": 8, "smooth_k": False, "smooth_v": False}),
    ("SageAttn2-4b", {"qk_bits": 4}),
    ("SageAttn2-4b, no smooth Q", {"qk_bits": 4, "smooth_q": False}),
]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sage_attn.accuracy", description=__doc__)
    ap.add_argument("--q", required=True)
    ap.add_argument("--k", required=True)
    ap.add_argument("--v", required=True)
    ap.add_argument("--layout", default="HND", choices=["HND", "NHD"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--causal-align", default="bottom_right", choices=["bottom_right", "top_left"])
    ap.add_argument("--scale", type=float, default=None)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--cpu", action="store_true", help="use the CPU reference even with a GPU")
    ap.add_argument("--no-fp4", action="store_true",
                    help="skip paper 004's FP4 table (CPU emulation; slow on long sequences)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        q, k, v = (to_4d(load(p), args.layout) for p in (args.q, args.k, args.v))
        for x, path in ((q, args.q), (k, args.k), (v, args.v)):
            check(x, path, args.layout, args.dtype)
        results, gpu, bad = run(q, k, v, args)
    except (InputError, ValueError, TypeError) as e:  # also the front ends' and library's
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"table": table, "config": label, **m} for table, label, m in results],
                         indent=1))
    else:
        print(f"q {tuple(q.shape)} k {tuple(k.shape)} ({args.layout}), causal {args.causal}, "
              f"{'GPU' if gpu else 'CPU reference'}; against float64 of the {args.dtype} inputs")
        table = None
        for name, label, m in results:
            if name != table:
                table = name
                if name != TABLE_SAGE:
                    print(f"\n{name}")
                print(f"{'':44s}{'CosSim':>12s}{'RelL1':>10s}{'RMSE':>11s}{'MaxAbs':>10s}")
            print(f"{label:44s}{m['cos'] * 100:11.4f}%{m['rel_l1']:10.5f}{m['rmse']:11.3e}"
                  f"{m['max_abs']:10.4f}")
    # After the table: a non-finite output fails the run (its metrics print as nan, which a
    # script reading the exit status would not see).
    for line in bad:
        print(f"{ap.prog}: {line}", file=sys.stderr)
    return 1 if bad else 0


TABLE_SAGE = "SageAttention2"
TABLE_FP4 = "FP4 microscaling, smoothed Q+K (paper 004 Table 1; CPU emulation)"


def run(q, k, v, args):
    """(results, gpu, bad): (table, label, metrics) per configuration, whether the GPU ran them,
    and a line for each output (the float64 reference's too) that has non-finite values."""
    try:
        import torch
        gpu = torch.cuda.is_available() and not args.cpu
    except ImportError:
        torch, gpu = None, False
    if args.dtype == "bf16" and not gpu:
        raise InputError("--dtype bf16 needs torch and a GPU (numpy has no bfloat16)")
    results, bad = [], []

    def add(label, out, ref=None, table=TABLE_SAGE):  # a row; without ref, the reference's check
        n = out.size - int(np.isfinite(out).sum())
        if n:
            bad.append(f"{label}: {n} of {out.size} outputs are not finite")
        if ref is not None:
            with np.errstate(invalid="ignore", over="ignore"):  # nan metrics: reported below
                results.append((table, label, sage_attn.metrics(out, ref)))

    kw = dict(tensor_layout=args.layout, is_causal=args.causal, sm_scale=args.scale,
              causal_align=args.causal_align)
    if gpu:
        dt = torch.float16 if args.dtype == "fp16" else torch.bfloat16
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x)).to("cuda", dt) for x in (q, k, v))
        ref = reference(tq, tk, tv, args)
        add("float64 reference", ref)
        for label, extra in CONFIGS:
            add(label, sage_attn.sageattn(tq, tk, tv, **kw, **extra).double().cpu().numpy(), ref)
        if not args.causal or args.causal_align == "top_left" or q.shape[1 if args.layout == 'NHD' else 2] == k.shape[1 if args.layout == 'NHD' else 2]:
            hnd = (lambda x: x) if args.layout == "HND" else (lambda x: x.transpose(1, 2))
            sd = torch.nn.functional.scaled_dot_product_attention(
                hnd(tq), hnd(tk), hnd(tv), is_causal=args.causal, scale=args.scale,
                enable_gqa=tq.shape[1] != tk.shape[1])
            add(f"SDPA {args.dtype}", hnd(sd).double().cpu().numpy(), ref)
    else:
        q16, k16, v16 = (np.ascontiguousarray(x, dtype=np.float16) for x in (q, k, v))
        ref = sage_attn.attention_numpy(*(x.astype(np.float32) for x in (q16, k16, v16)),
                                        exact=True, **kw)
        add("float64 reference", ref)
        for label, extra in CONFIGS:
            add(label + " (CPU emulation)", sage_attn.attention_numpy(q16, k16, v16, **kw, **extra),
                ref)
    if not args.no_fp4:
        # The inputs as the GPU rounded them (bf16 values are exact in float32).
        host = (tuple(x.float().cpu().numpy() for x in (tq, tk, tv)) if gpu and args.dtype == "bf16"
                else tuple(np.ascontiguousarray(x, dtype=np.float16) for x in (q, k, v)))
        for label, cfg in _fp4_configs():
            add(label, sage_attn.attention_numpy(*host, **kw, quant=cfg), ref, TABLE_FP4)
    return results, gpu, bad


def reference(tq, tk, tv, args):
    """float64 attention of the (rounded) inputs on the GPU, as a numpy array in the input layout."""
    import torch

    from .bench import reference64
    nhd = args.layout == "NHD"
    hnd = (lambda x: x.transpose(1, 2)) if nhd else (lambda x: x)
    q, k, v = hnd(tq), hnd(tk), hnd(tv)
    top_left = args.causal_align == "top_left"
    outs = [reference64(q[b], k[b], v[b], args.causal, args.scale, top_left=top_left)
            for b in range(q.shape[0])]
    o = hnd(torch.stack(outs))
    return o.cpu().numpy()


if __name__ == "__main__":
    sys.exit(main())
