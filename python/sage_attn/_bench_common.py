"""The torch-free half of `python -m sage_attn.bench`: the command line, the row schema
(ROW_FIELDS), the JSON writer, the markdown tables and the plot. Kept apart from bench.py so
that the report code is tested on machines without torch or a GPU (tests/python)."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

# sage-8b: the kernel the library picks (the wgmma kernel on sm_90); sage-8b-mma forces the
# mma.sync kernel; sdpa-dropin is sage_attn.scaled_dot_product_attention (its row's `choice` says
# whether the plan sent the call to sage or to torch); cudnn-fp8 is cuDNN's FP8 attention on
# pre-quantized inputs (kernel-only: the anchor the bar is set against).
IMPLS = ("sage-8b", "sage-8b-mma", "sage-4b", "sdpa-dropin", "sdpa-cudnn", "sdpa-flash", "cudnn-fp8")
DEFAULT_IMPLS = "sage-8b,sdpa-dropin,sdpa-cudnn,sdpa-flash,cudnn-fp8"
# Implementations whose figure is the GPU time of pre-quantized inputs only.
KERNEL_ONLY = ("cudnn-fp8",)
# The JSON row, in order; a figure that does not apply is null.
ROW_FIELDS = ("impl", "head_dim", "seq_len", "batch", "heads", "causal", "e2e_tops", "graph_tops",
              "kernel_tops", "ms", "cos", "rel_l1", "rmse", "max_abs", "host_us", "choice")


def new_row(impl, head_dim, seq_len, batch, heads, causal):
    row = dict.fromkeys(ROW_FIELDS)
    row.update(impl=impl, head_dim=head_dim, seq_len=seq_len, batch=batch, heads=heads,
               causal=causal)
    return row


def flops(batch, heads, seq_len, head_dim, causal):
    """Forward FLOPs (docs/performance.md): 4·B·H·N²·D, halved for causal."""
    return 4.0 * batch * heads * seq_len * seq_len * head_dim / (2 if causal else 1)


def cuda_missing(prog, torch):
    """Why `python -m prog` cannot benchmark here (printed to stderr), or None: it needs torch
    (the module passes its import, None when that failed) and a CUDA device."""
    if torch is None:
        reason = f"python -m {prog} needs PyTorch (import torch failed)"
    elif not torch.cuda.is_available():
        reason = "no CUDA device: nothing to benchmark"
    else:
        return None
    print(reason, file=sys.stderr)
    return reason


def gpu_slug(name):
    """The GPU's short name in result file names: "NVIDIA H100 80GB HBM3" -> "h100"; no name
    (a CPU run) -> "cpu"."""
    return name.lower().replace("nvidia ", "").split()[0] if name else "cpu"


def tops(flop_count, ms):
    return None if ms is None or ms <= 0 else round(flop_count / ms / 1e9, 2)


def _int_list(text):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def build_parser(doc=None):
    ap = argparse.ArgumentParser(prog="python -m sage_attn.bench", description=doc)
    ap.add_argument("--out", default="bench/results", help="directory for the JSON and the PNG")
    ap.add_argument("--dims", type=_int_list, default=[64, 128])
    ap.add_argument("--seqs", type=_int_list, default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--causal", default="both", choices=["both", "0", "1"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--impls", default=DEFAULT_IMPLS, help="comma list of " + ",".join(IMPLS))
    ap.add_argument("--inputs", default="normal", choices=["normal", "bias"])
    ap.add_argument("--accuracy-heads", type=int, default=8,
                    help="heads of batch 0 checked against float64 (0: no accuracy columns)")
    ap.add_argument("--seconds", type=float, default=0.25, help="timed seconds per figure")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph column")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time column")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--host-time", action="store_true",
                    help="instead of the grid: the host microseconds per eager call of torch's "
                         "SDPA, sageattn and the SDPA drop-in (as it routes, and with its "
                         "crossover off) at ViT-L, DiT-XL/2 and Flux shapes, each paired with "
                         "SDPA round by round (--out, --tag, --seed apply)")
    ap.add_argument("--host-rounds", type=int, default=200,
                    help="--host-time: rounds, median (default 200)")
    ap.add_argument("--host-calls", type=int, default=5,
                    help="--host-time: calls of each function a round (default 5)")
    ap.add_argument("--models", action="store_true",
                    help="the real-model table instead of the grid (python -m "
                         "sage_attn.bench_models: --out, --seconds and --commit apply)")
    return ap


def parse_args(argv=None, doc=None):
    """The parsed command line, with impls a list and causals a list of bools; exits with a usage
    message (status 2) on a bad value."""
    ap = build_parser(doc)
    args = ap.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    for i in args.impls:
        if i not in IMPLS:
            ap.error(f"--impls: unknown implementation {i!r} (known: {', '.join(IMPLS)})")
    if not args.impls:
        ap.error("--impls: name at least one implementation")
    if args.batch <= 0 or args.heads <= 0:
        ap.error("--batch and --heads must be positive")
    if not args.seconds > 0:
        ap.error("--seconds must be positive")
    if args.host_rounds <= 0 or args.host_calls <= 0:
        ap.error("--host-rounds and --host-calls must be positive")
    args.causals = {"both": [False, True], "0": [False], "1": [True]}[args.causal]
    return args


def write_json(path, meta, rows):
    """The results file: the header fields on one line, then one row per line (diff-friendly)."""
    head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items() if k != "rows")
    body = ",\n".join("  " + json.dumps({k: r.get(k) for k in ROW_FIELDS}) for r in rows)
    with open(path, "w") as f:
        f.write("{" + head + ', "rows": [\n' + body + "\n]}\n")


def _find(rows, impl, d, c, n):
    return next((r for r in rows if (r["impl"], r["head_dim"], r["causal"], r["seq_len"]) ==
                 (impl, d, c, n)), None)


def _num(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


def _keys(rows):
    return sorted({(r["head_dim"], r["causal"], r["seq_len"]) for r in rows})


def _n_label(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def impl_table(rows):
    """Every implementation per (D, causal, N): graph TOPS / eager TOPS (kernel-only in
    brackets), and rel-L1 against float64."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    head = ("| D | causal | N | " + " | ".join(impls) + " | " +
            " | ".join(f"{i} rel-L1" for i in impls) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(impls))]
    for d, c, n in _keys(rows):
        cells, accs = [], []
        for i in impls:
            r = _find(rows, i, d, c, n)
            if r is None:
                cells.append("-")
                accs.append("-")
                continue
            if i in KERNEL_ONLY:
                cell = f"({_num(r['kernel_tops'])})"
            else:
                cell = f"{_num(r['graph_tops'])} / {_num(r['e2e_tops'])}"
                if r.get("kernel_tops"):
                    cell += f" ({r['kernel_tops']:.0f})"
            cells.append(cell)
            accs.append(_num(r["rel_l1"], "{:.4f}"))
        lines.append(f"| {d} | {'yes' if c else 'no'} | {_n_label(n)} | " + " | ".join(cells) +
                     " | " + " | ".join(accs) + " |")
    return "\n".join(lines)


def summary_row(rows, d, c, n):
    """The figures the bar is judged on for one shape (None where a figure is missing):
    R = min(SDPA cuDNN graph, cuDNN FP8 kernel-only) of the same run."""
    sage, cudnn, fp8, dropin = (_find(rows, i, d, c, n) for i in
                                ("sage-8b", "sdpa-cudnn", "cudnn-fp8", "sdpa-dropin"))
    get = lambda r, k: None if r is None else r.get(k)  # noqa: E731
    anchors = [x for x in (get(cudnn, "graph_tops"), get(fp8, "kernel_tops")) if x]
    r_value = min(anchors) if anchors else None
    sage_graph = get(sage, "graph_tops")
    return {"sage_graph": sage_graph, "sage_eager": get(sage, "e2e_tops"),
            "cudnn_graph": get(cudnn, "graph_tops"), "cudnn_eager": get(cudnn, "e2e_tops"),
            "fp8_kernel": get(fp8, "kernel_tops"), "R": r_value,
            "ratio": sage_graph / r_value if sage_graph and r_value else None,
            "sage_host_us": get(sage, "host_us"), "cudnn_host_us": get(cudnn, "host_us"),
            "choice": get(dropin, "choice")}


def summary_table(rows):
    """Per (D, causal, N): sage and SDPA cuDNN fp16 under CUDA-graph replay and eager, cuDNN FP8
    kernel-only, R, sage graph / R, host microseconds per eager call, and the drop-in's choice."""
    lines = ["| D | causal | N | sage graph | sage eager | cuDNN fp16 graph | cuDNN fp16 eager | "
             "cuDNN FP8 kernel | R | sage graph / R | sage host µs | SDPA cuDNN host µs | "
             "drop-in |",
             "|" + "---|" * 13]
    for d, c, n in _keys(rows):
        s = summary_row(rows, d, c, n)
        lines.append(
            f"| {d} | {'yes' if c else 'no'} | {_n_label(n)} | {_num(s['sage_graph'])} | "
            f"{_num(s['sage_eager'])} | {_num(s['cudnn_graph'])} | {_num(s['cudnn_eager'])} | "
            f"{_num(s['fp8_kernel'])} | {_num(s['R'])} | {_num(s['ratio'], '{:.2f}')} | "
            f"{_num(s['sage_host_us'])} | {_num(s['cudnn_host_us'])} | {s['choice'] or '-'} |")
    return "\n".join(lines)


def plot(rows, path, title):
    """TOPS vs N per head dim and mask: CUDA-graph TOPS (solid) of every implementation, cuDNN
    FP8's kernel-only TOPS solid too (its only figure), sage's kernel-only dashed. False when
    matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    dims = sorted({r["head_dim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    seqs = sorted({r["seq_len"] for r in rows})
    fig, axes = plt.subplots(len(dims), len(causals), figsize=(6 * len(causals), 4.2 * len(dims)),
                             squeeze=False)
    for i, d in enumerate(dims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for impl in IMPLS:
                mine = sorted((r for r in rows if r["impl"] == impl and r["head_dim"] == d
                               and r["causal"] == causal), key=lambda r: r["seq_len"])
                solid_key, label = "graph_tops", f"{impl} graph"
                if impl in KERNEL_ONLY:
                    solid_key, label = "kernel_tops", f"{impl} kernel-only"
                pts = [(r["seq_len"], r[solid_key]) for r in mine if r[solid_key]]
                color = None
                if pts:
                    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                    label=label)
                    color = line.get_color()
                if impl not in KERNEL_ONLY:
                    kpts = [(r["seq_len"], r["kernel_tops"]) for r in mine if r["kernel_tops"]]
                    if kpts:
                        ax.plot([p[0] for p in kpts], [p[1] for p in kpts], ls="--", color=color,
                                label=f"{impl} kernel-only")
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs, [_n_label(n) for n in seqs])
            ax.set_ylim(bottom=0)
            ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TOPS")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(pathlib.Path(path), dpi=110)
    plt.close(fig)
    return True
