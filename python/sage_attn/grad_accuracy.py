"""python -m sage_attn.grad_accuracy: how accurate SageBwd's gradients are on inputs with the
structure real models' attention has (outlier channels, a channel bias, an attention sink,
peaked scores, GQA, causal masks), beside torch's SDPA in the same dtype.

For each input class x head dim x dtype x mask x N x GQA ratio: dQ, dK and dV of sage
(`sageattn` forward, then autograd's backward: SageBwd) and of torch's SDPA in the input dtype
(its default backend, enable_gqa=True), each against float64 of the same dtype-rounded inputs
(computed head by head in chunks of query rows, so N = 16k never holds B·H·N² at once): cos and
rel-L1 (Σ|x − t| / Σ|t|) per gradient, and the path sage's backward took ("8-bit", or "16-bit"
where its accuracy check sent the call to a 16-bit recompute; "8-bit NaN" where the gradients
came back not finite: what the library returns for a call its check refuses, when nothing
recomputed it). Prints a markdown table; writes <out>/<date>-<gpu>-grad-accuracy.json (the run's
metadata on one line, then one row per line).

    python -m sage_attn.grad_accuracy --out bench/results
    python -m sage_attn.grad_accuracy --device cpu --seqs 128 --dims 64 --heads 2 \\
        --classes normal,outlier_scale:10

CPU tensors run the library's CPU emulation of the kernels (fp16, bf16 and fp32 inputs); CUDA
tensors the kernels (fp16, bf16). --classes takes name[:value...]: the values fill the
generator's parameters after the shape, in order (outlier_scale:16:8 is m = 16 on 8 channels).
The inputs of one (class, D, N, GQA ratio) are the same float32 draw for every dtype and mask.

Input classes (each a public generator below, deterministic from its seed):
  normal               q, k, v, dO ~ N(0, 1)
  outlier_scale:m      4 channels of Q and K (the same ones) multiplied by m (4..16)
  outlier_bias:m       the same channels offset by ±m (one random sign a channel, shared by Q, K)
  sink:m[:keys]        key 0 (or keys 0..keys-1) m times the other keys' norm, along the mean
                       query direction, so that it is attended (5..10)
  peaked:sd            Q scaled so that the scores q·k·scale have standard deviation sd (to 20)
  outlier_sink:m:sm    outlier_scale m, then a sink of strength sm
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import pathlib
import subprocess
import sys
import warnings
import zlib

import sage_attn

from ._bench_common import _int_list, gpu_slug

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --help and argument errors work without torch; main() says it is needed
    torch = None

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
MASKS = ("none", "causal")
DEFAULT_CLASSES = ("normal,outlier_scale:8,outlier_scale:16,outlier_bias:8,sink:8,peaked:10,"
                   "peaked:20,outlier_sink:8:8")
GRADS = ("dq", "dk", "dv")
IMPLS = ("sage", "sdpa")
# The JSON row, in order; a figure that does not apply (or that failed) is null.
ROW_FIELDS = (("class", "generator", "params", "head_dim", "dtype", "mask", "seq_len", "batch",
               "heads", "heads_kv", "path")
              + tuple(f"{i}_{g}_{m}" for i in IMPLS for g in GRADS for m in ("cos", "rel_l1"))
              + ("sage_error", "sdpa_error"))


# --- input generators ------------------------------------------------------------------------
# Each returns (q, k, v, d_o) in HND: q and d_o [B, H, N, D], k and v [B, heads_kv, N, D] (query
# head h reads KV head h // (H / heads_kv), SDPA's enable_gqa convention). The draw is float32 on
# the CPU from the seed, so the same seed gives the same values on every device, rounded to
# `dtype` (a torch dtype or "fp16", "bf16", "fp32"; default float32) last.

def _sub_seed(seed, what):
    # Independent streams of one seed for the base draw and for a class's own choices.
    return zlib.crc32(f"{seed}:{what}".encode()) & 0x7FFFFFFF


def _torch_dtype(dtype):
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype = {dtype!r}: must be one of {', '.join(DTYPES)}")
        return getattr(torch, DTYPES[dtype])
    return dtype


def _base(batch, heads, seq, head_dim, heads_kv, seed):
    heads_kv = heads if heads_kv is None else heads_kv
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"heads_kv = {heads_kv}: must divide heads = {heads}")
    g = torch.Generator().manual_seed(_sub_seed(seed, "base"))
    q = torch.randn((batch, heads, seq, head_dim), generator=g)
    k = torch.randn((batch, heads_kv, seq, head_dim), generator=g)
    v = torch.randn((batch, heads_kv, seq, head_dim), generator=g)
    d_o = torch.randn((batch, heads, seq, head_dim), generator=g)
    return q, k, v, d_o


def _finish(tensors, dtype, device):
    dt = _torch_dtype(dtype)
    return tuple(x.to(dtype=dt).to(device) for x in tensors)


def outlier_channels(head_dim, channels=4, seed=0):
    """The channels outlier_scale, outlier_bias and outlier_sink pick for this seed (sorted),
    and one sign a channel (±1.0) that outlier_bias uses."""
    if not 0 < channels <= head_dim:
        raise ValueError(f"channels = {channels}: must be in 1..head_dim ({head_dim})")
    g = torch.Generator().manual_seed(_sub_seed(seed, "channels"))
    idx = torch.randperm(head_dim, generator=g)[:channels].sort().values
    signs = torch.randint(0, 2, (channels,), generator=g).float() * 2 - 1
    return idx, signs


def _scale_channels(q, k, channels, m, seed):
    idx, _ = outlier_channels(q.shape[-1], channels, seed)
    q[..., idx] *= m
    k[..., idx] *= m


def _add_sink(q, k, m, keys, align, seed):
    """Queries get a shared component `align` (in units of a channel's std) along a random unit
    direction per KV group; keys 0..keys-1 then point along the group's mean query direction
    (the first exactly, the others mixed with their own draw) with m times the mean norm of the
    other keys: their scores are about m·(align + N(0, 1)), so most rows attend them."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    if not 0 < keys < n:
        raise ValueError(f"keys = {keys}: must be in 1..N-1 (N = {n})")
    g = torch.Generator().manual_seed(_sub_seed(seed, "sink"))
    shared = torch.randn((b, hkv, 1, d), generator=g)
    shared /= shared.norm(dim=-1, keepdim=True)
    q += align * shared.repeat_interleave(hq // hkv, 1)
    mean_q = q.reshape(b, hkv, (hq // hkv) * n, d).mean(dim=2)
    mean_q /= mean_q.norm(dim=-1, keepdim=True)
    norm = k[:, :, keys:].norm(dim=-1).mean(dim=-1, keepdim=True)  # [B, Hkv, 1]
    for j in range(keys):
        own = k[:, :, j] / k[:, :, j].norm(dim=-1, keepdim=True)
        direction = mean_q if j == 0 else mean_q + 0.5 * own
        k[:, :, j] = m * norm * direction / direction.norm(dim=-1, keepdim=True)


def score_std(q, k, scale=None, rows=256, keys=4096):
    """The standard deviation of q·kᵀ·scale over (query, key) pairs of every head (KV head
    h // (Hq / Hkv) for query head h), estimated on the first `rows` queries and `keys` keys."""
    hq, hkv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qs = q[:, :, :rows].float()
    ks = k[:, :, :keys].float().repeat_interleave(hq // hkv, 1)
    return float((qs @ ks.transpose(-1, -2) * scale).std())


def normal(batch, heads, seq, head_dim, *, heads_kv=None, dtype=None, device="cpu", seed=0):
    """q, k, v, dO ~ N(0, 1)."""
    return _finish(_base(batch, heads, seq, head_dim, heads_kv, seed), dtype, device)


def outlier_scale(batch, heads, seq, head_dim, m=8.0, channels=4, *, heads_kv=None, dtype=None,
                  device="cpu", seed=0):
    """N(0, 1) with `channels` channels of Q and K (the same ones: outlier_channels) multiplied
    by m, the outlier channels of trained models' queries and keys (m 4..16): they set the INT8
    scale of every token, so the other channels keep fewer levels."""
    q, k, v, d_o = _base(batch, heads, seq, head_dim, heads_kv, seed)
    _scale_channels(q, k, channels, m, seed)
    return _finish((q, k, v, d_o), dtype, device)


def outlier_bias(batch, heads, seq, head_dim, m=8.0, channels=4, *, heads_kv=None, dtype=None,
                 device="cpu", seed=0):
    """N(0, 1) with a constant offset ±m on `channels` channels of Q and K (the channels and
    the per-channel signs of outlier_channels, the same in Q and K). K's offset is what K
    smoothing removes; Q's stays in its INT8 scale."""
    q, k, v, d_o = _base(batch, heads, seq, head_dim, heads_kv, seed)
    idx, signs = outlier_channels(head_dim, channels, seed)
    q[..., idx] += m * signs
    k[..., idx] += m * signs
    return _finish((q, k, v, d_o), dtype, device)


def sink(batch, heads, seq, head_dim, m=8.0, keys=1, align=1.0, *, heads_kv=None, dtype=None,
         device="cpu", seed=0):
    """N(0, 1) with an attention sink: key 0 (keys 0..keys-1 with keys > 1) m times the mean
    norm of the other keys (m 5..10), along the mean query direction, the queries sharing a
    component `align` along it (see _add_sink). Its K block's INT8 scale is m times the
    others'."""
    q, k, v, d_o = _base(batch, heads, seq, head_dim, heads_kv, seed)
    _add_sink(q, k, m, int(keys), align, seed)
    return _finish((q, k, v, d_o), dtype, device)


def peaked(batch, heads, seq, head_dim, sd=10.0, *, heads_kv=None, dtype=None, device="cpu",
           seed=0):
    """N(0, 1) with Q scaled so that the scores q·kᵀ/sqrt(D) have standard deviation about sd
    (score_std; N(0, 1) inputs have 1): near one-hot softmax rows at sd 10..20, where the
    score error of INT8 Q·Kᵀ grows with the scores."""
    q, k, v, d_o = _base(batch, heads, seq, head_dim, heads_kv, seed)
    q *= sd / score_std(q, k)
    return _finish((q, k, v, d_o), dtype, device)


def outlier_sink(batch, heads, seq, head_dim, m=8.0, sink_m=8.0, channels=4, keys=1, *,
                 heads_kv=None, dtype=None, device="cpu", seed=0):
    """outlier_scale(m, channels), then sink(sink_m, keys) on those inputs (the sink's norm is
    measured on the outlier keys)."""
    q, k, v, d_o = _base(batch, heads, seq, head_dim, heads_kv, seed)
    _scale_channels(q, k, channels, m, seed)
    _add_sink(q, k, sink_m, int(keys), 1.0, seed)
    return _finish((q, k, v, d_o), dtype, device)


CLASSES = {"normal": normal, "outlier_scale": outlier_scale, "outlier_bias": outlier_bias,
           "sink": sink, "peaked": peaked, "outlier_sink": outlier_sink}


def parse_class(spec):
    """'name[:value...]' -> (generator, {parameter: value}); the values fill the generator's
    parameters after (batch, heads, seq, head_dim), in order. ValueError names what is wrong."""
    name, *values = spec.split(":")
    if name not in CLASSES:
        raise ValueError(f"{spec!r}: unknown class {name!r} (known: {', '.join(CLASSES)})")
    fn = CLASSES[name]
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind is p.POSITIONAL_OR_KEYWORD][4:]
    if len(values) > len(params):
        raise ValueError(f"{spec!r}: {name} takes at most {len(params)} values "
                         f"({', '.join(p.name for p in params) or 'none'})")
    kwargs = {}
    for p, text in zip(params, values):
        try:
            x = float(text)
        except ValueError:
            raise ValueError(f"{spec!r}: {p.name} = {text!r} is not a number") from None
        if isinstance(p.default, int):
            if x != int(x):
                raise ValueError(f"{spec!r}: {p.name} = {text!r} must be an integer")
            x = int(x)
        kwargs[p.name] = x
    return fn, kwargs


# --- the float64 truth -----------------------------------------------------------------------

def attention_grad64(q, k, v, d_o, causal=False, scale=None, rows=None):
    """float64 O, dQ, dK, dV of O = softmax(q·kᵀ·scale)·v for the upstream gradient d_o, on q's
    device. q, d_o [B, Hq, Nq, D]; k, v [B, Hkv, Nk, D] (query head h reads KV head
    h // (Hq / Hkv); dK and dV sum over the query heads of a group). causal: key j is visible
    from query i when j <= i + Nk − Nq (bottom-right, sageattn's default; the same as SDPA's
    top-left when Nq == Nk). scale None: 1/sqrt(D).

    One query head and `rows` query rows at a time (default: about 16M scores a chunk), so
    memory is a few rows x Nk float64 matrices, never B·H·Nq·Nk. Each chunk holds whole rows, so
    one pass is exact: S = q·kᵀ·scale, P = softmax(S), O = P·V, dP = dO·Vᵀ, D = rowsum(P∘dP),
    dS = P∘(dP − D), dQ = scale·dS·K, dK += scale·dSᵀ·Q, dV += Pᵀ·dO. A row with no visible key
    gets O = 0 and no gradient."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of key heads {hkv}")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = rows or max(1, (1 << 24) // max(nk, 1))
    f64 = torch.float64
    dev = q.device
    o = torch.empty(q.shape, dtype=f64, device=dev)
    dq = torch.empty(q.shape, dtype=f64, device=dev)
    dk = torch.zeros(k.shape, dtype=f64, device=dev)
    dv = torch.zeros(v.shape, dtype=f64, device=dev)
    j = torch.arange(nk, device=dev)[None, :]
    for bi in range(b):
        for g in range(hkv):
            kh, vh = k[bi, g].to(f64), v[bi, g].to(f64)
            for h in range(g * group, (g + 1) * group):
                for r0 in range(0, nq, rows):
                    r1 = min(nq, r0 + rows)
                    qc, doc = q[bi, h, r0:r1].to(f64), d_o[bi, h, r0:r1].to(f64)
                    s = (qc @ kh.T) * scale
                    if causal:
                        i = torch.arange(r0, r1, device=dev)[:, None]
                        s.masked_fill_(j > i + (nk - nq), float("-inf"))
                    mx = s.amax(dim=-1, keepdim=True)
                    p = torch.exp(s - torch.where(torch.isfinite(mx), mx, 0.0))
                    den = p.sum(dim=-1, keepdim=True)
                    p /= torch.where(den > 0, den, 1.0)
                    o[bi, h, r0:r1] = p @ vh
                    dp = doc @ vh.T
                    ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
                    dq[bi, h, r0:r1] = (ds @ kh) * scale
                    dk[bi, g] += (ds.T @ qc) * scale
                    dv[bi, g] += p.T @ doc
    return o, dq, dk, dv


def grad_metrics(x, truth):
    """cos and rel-L1 (Σ|x − t| / Σ|t|) of x against the float64 truth, in float64 (NaN when x
    is not finite)."""
    x = x.detach().to(torch.float64)
    t = truth.to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        return {"cos": math.nan, "rel_l1": math.nan}
    cos = (x * t).sum() / (x.norm() * t.norm()).clamp_min(1e-300)
    rel = (x - t).abs().sum() / t.abs().sum().clamp_min(1e-300)
    return {"cos": float(cos), "rel_l1": float(rel)}


# --- sage and SDPA ---------------------------------------------------------------------------
def backward_path(step):
    """Runs step() (one sage forward + backward) and returns "16-bit" when SageBwd's accuracy
    check sent the backward to a 16-bit recompute (sage_attn.backward_fallbacks() grew), else
    "8-bit". The recompute's warning is silenced; other warnings pass through."""
    before = sage_attn.backward_fallbacks()
    # Every call checked: the table is of the check's verdicts, not of the calls that skip the
    # 8-bit attempt after refusals of their kind (sage_attn.set_backward_retry).
    sage_attn.set_backward_retry(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sage_attn.SageBwdFallbackWarning)
            step()
    finally:
        sage_attn.set_backward_retry(True)
    return "16-bit" if sage_attn.backward_fallbacks() > before else "8-bit"


def _grads(fn, q, k, v, d_o, causal):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    fn(qq, kk, vv, causal).backward(d_o)
    return qq.grad, kk.grad, vv.grad


def _sage(q, k, v, causal):
    return sage_attn.sageattn(q, k, v, tensor_layout="HND", is_causal=causal)


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _why(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def measure(q, k, v, d_o, causal, row):
    """Fills row's figures for these inputs: the float64 truth, sage's gradients and path,
    SDPA's gradients. A failing implementation leaves its figures null and its error named."""
    _, *truth = attention_grad64(q, k, v, d_o, causal)
    try:
        grads = []
        row["path"] = backward_path(lambda: grads.extend(_grads(_sage, q, k, v, d_o, causal)))
        if row["path"] == "8-bit" and not all(bool(torch.isfinite(g).all()) for g in grads):
            row["path"] = "8-bit NaN"
        for name, x, t in zip(GRADS, grads, truth):
            for m, val in grad_metrics(x, t).items():
                row[f"sage_{name}_{m}"] = val
    except Exception as e:  # a shape or dtype the library does not take here: the row goes on
        row["sage_error"] = _why(e)
    try:
        for name, x, t in zip(GRADS, _grads(_sdpa, q, k, v, d_o, causal), truth):
            for m, val in grad_metrics(x, t).items():
                row[f"sdpa_{name}_{m}"] = val
    except Exception as e:  # (as above: SDPA without a kernel for the dtype or device)
        row["sdpa_error"] = _why(e)
    return row


# --- the report ------------------------------------------------------------------------------

def _num(x, fmt):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _pair(row, grad, metric, fmt):
    return " / ".join(_num(row.get(f"{i}_{grad}_{metric}"), fmt) for i in IMPLS)


def table(rows):
    """The markdown table: one line per row, in the order given; cells are sage / SDPA."""
    head = ("| class | D | dtype | mask | N | Hq:Hkv | path | "
            + " | ".join(f"d{g[1:].upper()} cos" for g in GRADS) + " | "
            + " | ".join(f"d{g[1:].upper()} rel-L1" for g in GRADS) + " |")
    lines = [head, "|" + "---|" * (7 + 2 * len(GRADS))]
    for r in rows:
        path = r["path"] or ("error" if r.get("sage_error") else "-")
        lines.append(
            f"| {r['class']} | {r['head_dim']} | {r['dtype']} | {r['mask']} | {r['seq_len']} | "
            f"{r['heads']}:{r['heads_kv']} | {path} | "
            + " | ".join(_pair(r, g, "cos", "{:.6f}") for g in GRADS) + " | "
            + " | ".join(_pair(r, g, "rel_l1", "{:.4f}") for g in GRADS) + " |")
    return "\n".join(lines)


def _json_value(x):
    # NaN and infinity are not JSON: null, like any figure that is missing.
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_json(path, meta, rows):
    """The metadata on one line, then one row per line (diff-friendly, as the other benches)."""
    head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items())
    body = ",\n".join("  " + json.dumps({k: _json_value(r.get(k)) for k in ROW_FIELDS})
                      for r in rows)
    with open(path, "w") as f:
        f.write("{" + head + ', "rows": [\n' + body + "\n]}\n")


def _list(text, allowed, flag):
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{flag}: {text!r} (choose from {', '.join(allowed)})")
    return items


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sage_attn.grad_accuracy",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default=DEFAULT_CLASSES,
                    help="comma list of name[:value...] (" + ", ".join(CLASSES) + ")")
    ap.add_argument("--dims", type=_int_list, default=[64, 128])
    ap.add_argument("--seqs", type=_int_list, default=[1024, 4096], help="N, Nq = Nk")
    ap.add_argument("--dtypes", default="fp16,bf16", help="comma list of fp16, bf16, fp32")
    ap.add_argument("--masks", default="none,causal", help="comma list of none, causal")
    ap.add_argument("--gqa", type=_int_list, default=[1, 4],
                    help="Hq / Hkv ratios (each must divide --heads)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="query heads")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON")
    ap.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD")
    a = ap.parse_args(argv)
    try:
        a.dtypes = _list(a.dtypes, DTYPES, "--dtypes")
        a.masks = _list(a.masks, MASKS, "--masks")
        a.classes = [(spec, *parse_class(spec)) for spec in a.classes.split(",") if spec]
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    if not a.classes:
        ap.error("--classes: name at least one class")
    if a.batch <= 0 or a.heads <= 0:
        ap.error("--batch and --heads must be positive")
    bad = [r for r in a.gqa if a.heads % r]
    if bad:
        print(f"--gqa {','.join(map(str, bad))}: not a divisor of --heads {a.heads}, skipped",
              file=sys.stderr)
        a.gqa = [r for r in a.gqa if not a.heads % r]
        if not a.gqa:
            ap.error("--gqa: no ratio divides --heads")
    return a


def _commit(given):
    if given is not None:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=pathlib.Path(__file__).resolve().parent,
                              timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _metadata(device, a, argv):
    gpu = driver = cudnn = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=20).stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
        if torch.backends.cudnn.is_available():
            cudnn = torch.backends.cudnn.version()
    return {"bench": "grad-accuracy", "device": device.type, "gpu": gpu or "cpu",
            "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
            "cudnn": cudnn, "sage": sage_attn.version(), "commit": _commit(a.commit),
            "date": datetime.date.today().isoformat(), "seed": a.seed, "batch": a.batch,
            "heads": a.heads, "argv": sys.argv[1:] if argv is None else list(argv)}


def main(argv=None):
    a = parse_args(argv)
    if torch is None:
        print("python -m sage_attn.grad_accuracy needs PyTorch (import torch failed)",
              file=sys.stderr)
        return 2
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    meta = _metadata(device, a, argv)
    print(f"{meta['gpu']}, torch {meta['torch']}, sage {meta['sage']}, commit {meta['commit']}; "
          f"B={a.batch} Hq={a.heads}, seed {a.seed}", flush=True)
    rows = []
    for spec, fn, kwargs in a.classes:
        for d in a.dims:
            for n in a.seqs:
                for ratio in a.gqa:
                    hkv = a.heads // ratio
                    # One float32 draw per (class, D, N, ratio), rounded per dtype below.
                    seed = _sub_seed(a.seed, f"{spec}/{d}/{n}/{ratio}")
                    try:
                        draw = fn(a.batch, a.heads, n, d, **kwargs, heads_kv=hkv, seed=seed)
                    except ValueError as e:  # a class parameter that does not fit the shape
                        print(f"--classes {spec}: {e}", file=sys.stderr)
                        return 2
                    for dtype in a.dtypes:
                        q, k, v, d_o = _finish(draw, dtype, device)
                        for mask in a.masks:
                            row = dict.fromkeys(ROW_FIELDS)
                            row.update({"class": spec, "generator": fn.__name__,
                                        "params": kwargs, "head_dim": d, "dtype": dtype,
                                        "mask": mask, "seq_len": n, "batch": a.batch,
                                        "heads": a.heads, "heads_kv": hkv})
                            measure(q, k, v, d_o, mask == "causal", row)
                            rows.append(row)
                            _print_row(row)
                        del q, k, v, d_o
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    # The table in the order of the grid's description: class, D, dtype, mask, N, GQA ratio.
    order = {spec: i for i, (spec, _, _) in reversed(list(enumerate(a.classes)))}
    rows.sort(key=lambda r: (order[r["class"]], r["head_dim"], a.dtypes.index(r["dtype"]),
                             a.masks.index(r["mask"]), r["seq_len"], -r["heads_kv"]))
    print()
    print("cos and rel-L1 against float64 of the same dtype-rounded inputs; cells: sage / SDPA")
    print()
    print(table(rows))
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{meta['date']}-{gpu_slug(meta['gpu'])}-grad-accuracy.json"
        write_json(path, meta, rows)
        print(f"\nwrote {path}")
    return 0


def _print_row(r):
    label = (f"{r['class']:16s} D={r['head_dim']:<3d} {r['dtype']} {r['mask']:6s} "
             f"N={r['seq_len']:<5d} {r['heads']}:{r['heads_kv']}")
    figures = "  ".join(
        f"{g} cos {_pair(r, g, 'cos', '{:.6f}')} rel-L1 {_pair(r, g, 'rel_l1', '{:.4f}')}"
        for g in GRADS)
    errors = "".join(f"\n{label}: {i} {r[f'{i}_error']}" for i in IMPLS if r.get(f"{i}_error"))
    print(f"{label} {r['path'] or '-'}  {figures}{errors}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
