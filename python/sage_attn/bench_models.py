"""python -m sage_attn.bench_models: the attention calls of real models, from their public configs
(image and video diffusion transformers and UNets, LLM prefill, vision and text encoders), timed
in one process: sage (SageAttn2-8b), torch's SDPA with the cuDNN and the flash backends, and the
SDPA drop-in (sage_attn.scaled_dot_product_attention) with its choice, and torch's SDPA with its
own backend choice (what a user had before the drop-in). GPU time under CUDA-graph replay, the
implementations' graphs replayed in turn over --rounds rounds (median), fp16 or bf16 N(0,1)
inputs. The drop-in's figure is the one the "never slower" rule reads, against the faster of
torch's two backends and against torch's own choice. Writes <out>/<date>-<gpu>-models.json and
prints a markdown table.

    python -m sage_attn.bench_models --out bench/results
    python -m sage_attn.bench_models --only flux,sdxl --dtype bf16
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import sage_attn

from ._bench_common import cuda_missing, gpu_slug

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # --help works without torch; main() says it is needed
    torch = None

# (model, call, B, Hq, Hkv, N, D, causal). B counts classifier-free guidance's two passes where
# the model's pipeline batches them; N the tokens one attention call sees.
MODELS = (
    # Image diffusion. Flux.1 at 1024²: 4096 image + 512 text tokens, 24 heads of 128.
    ("flux", "flux.1 1024² joint", 1, 24, 24, 4608, 128, False),
    # SD3.5 Large at 1024²: 4096 image + 333 text tokens, 38 heads of 64; CFG batch 2.
    ("sd3.5", "sd3.5-large 1024² joint", 2, 38, 38, 4429, 64, False),
    # SDXL at 1024² (128² latent): self-attention at 64² (10 heads of 64) and 32² (20 heads).
    ("sdxl", "sdxl 1024² level 1", 2, 10, 10, 4096, 64, False),
    ("sdxl", "sdxl 1024² level 2", 2, 20, 20, 1024, 64, False),
    # SD 1.5 at 512² (64² latent): 8 heads of 40 / 80 / 160 at 64², 32², 16².
    ("sd1.5", "sd1.5 512² level 1", 2, 8, 8, 4096, 40, False),
    ("sd1.5", "sd1.5 512² level 2", 2, 8, 8, 1024, 80, False),
    ("sd1.5", "sd1.5 512² level 3", 2, 8, 8, 256, 160, False),
    # PixArt-α/Σ at 1024²: 64² patches, 16 heads of 72. DiT-XL/2 at 512²: 32² patches.
    ("pixart", "pixart-sigma 1024²", 2, 16, 16, 4096, 72, False),
    ("dit", "dit-xl/2 512²", 2, 16, 16, 1024, 72, False),
    # AuraFlow at 1024²: 4096 image + 256 text tokens, 24 heads of 128.
    ("auraflow", "auraflow 1024² joint", 2, 24, 24, 4352, 128, False),
    # Video diffusion.
    ("wan", "wan2.1-14b 480p", 1, 40, 40, 32760, 128, False),
    ("hunyuan", "hunyuanvideo 720p", 1, 24, 24, 119040, 128, False),
    ("cogvideox", "cogvideox-5b", 2, 48, 48, 17776, 64, False),
    ("ltx", "ltx-video 768x512x121", 2, 32, 32, 6144, 64, False),
    ("mochi", "mochi-1 480p", 1, 24, 24, 44520, 128, False),
    # LLM prefill (causal, GQA).
    ("llama3-8b", "llama3-8b prefill 1k", 1, 32, 8, 1024, 128, True),
    ("llama3-8b", "llama3-8b prefill 4k", 1, 32, 8, 4096, 128, True),
    ("llama3-8b", "llama3-8b prefill 8k", 1, 32, 8, 8192, 128, True),
    ("llama3-8b", "llama3-8b prefill 32k", 1, 32, 8, 32768, 128, True),
    ("llama3-70b", "llama3-70b prefill 4k", 1, 64, 8, 4096, 128, True),
    ("llama3-70b", "llama3-70b prefill 32k", 1, 64, 8, 32768, 128, True),
    ("qwen2.5-7b", "qwen2.5-7b prefill 4k", 1, 28, 4, 4096, 128, True),
    ("qwen2.5-7b", "qwen2.5-7b prefill 16k", 1, 28, 4, 16384, 128, True),
    ("mistral-7b", "mistral-7b prefill 8k", 1, 32, 8, 8192, 128, True),
    # Encoders (batched inference).
    ("vit", "vit-b/16 224²", 64, 12, 12, 197, 64, False),
    ("clip", "clip vit-l/14 224²", 64, 16, 16, 257, 64, False),
    ("siglip", "siglip so400m 384²", 32, 16, 16, 729, 72, False),
    ("clip", "clip text encoder", 64, 12, 12, 77, 64, False),
)


def _flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def _impls(q, k, v, causal, hq, hkv):
    """name -> callable; SDPA gets K and V repeated over the group (enable_gqa is flash-only)."""
    kk = k.repeat_interleave(hq // hkv, 1) if hq != hkv else k
    vv = v.repeat_interleave(hq // hkv, 1) if hq != hkv else v

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal)
        return run

    return {
        "sage-8b": lambda: sage_attn.sageattn(q, k, v, is_causal=causal),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        # What the user had before the drop-in: torch's own choice of backend, GQA as the
        # drop-in passes it (enable_gqa) when it hands the call over.
        "sdpa-default": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                               enable_gqa=hq != hkv),
        "sdpa-dropin": lambda: sage_attn.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=hq != hkv),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sage_attn.bench_models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only", default="", help="comma list of model names (default: all)")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--seconds", type=float, default=0.25, help="timing target per figure")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds the implementations' graphs are replayed in turn (median)")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    if cuda_missing("sage_attn.bench_models", torch):
        return 2
    from .bench import interleaved_ms
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model, call, b, hq, hkv, n, d, causal in MODELS:
        if only and model not in only:
            continue
        q = torch.randn((b, hq, n, d), generator=gen, device="cuda", dtype=dtype)
        k = torch.randn((b, hkv, n, d), generator=gen, device="cuda", dtype=dtype)
        v = torch.randn((b, hkv, n, d), generator=gen, device="cuda", dtype=dtype)
        row = {"model": model, "call": call, "batch": b, "heads_q": hq, "heads_kv": hkv,
               "seq_len": n, "head_dim": d, "causal": causal,
               "choice": sage_attn.dropin_backend(q, k, v, is_causal=causal,
                                                  enable_gqa=hq != hkv)}
        times = interleaved_ms(_impls(q, k, v, causal, hq, hkv), args.seconds, args.rounds,
                                lambda msg: print(f"{call}: {msg}", flush=True))
        for name, ms in times.items():
            row[name + "_ms"] = ms
        sdpa = [x for x in (row["sdpa-cudnn_ms"], row["sdpa-flash_ms"]) if x is not None]
        best = min(sdpa) if sdpa else None
        row["sage_vs_sdpa"] = best / row["sage-8b_ms"] if best and row["sage-8b_ms"] else None
        row["dropin_vs_sdpa"] = (best / row["sdpa-dropin_ms"] if best and row["sdpa-dropin_ms"]
                                 else None)
        dflt = row["sdpa-default_ms"]
        row["dropin_vs_default"] = (dflt / row["sdpa-dropin_ms"] if dflt and row["sdpa-dropin_ms"]
                                    else None)
        row["tops_sage"] = _flops(b, hq, n, d, causal) / row["sage-8b_ms"] / 1e9 \
            if row["sage-8b_ms"] else None
        rows.append(row)
        print(f"{call:28s} B={b:<3d} H={hq:<3d}/{hkv:<3d} N={n:<7d} D={d:<4d} "
              f"sage {row['sage-8b_ms']} ms, cudnn {row['sdpa-cudnn_ms']}, "
              f"flash {row['sdpa-flash_ms']}, drop-in {row['sdpa-dropin_ms']} ({row['choice']})",
              flush=True)
        del q, k, v
    print("\n| call | B | Hq/Hkv | N | D | causal | sage ms | cuDNN ms | flash ms | SDPA ms | "
          "sage vs best SDPA | drop-in | drop-in vs best SDPA | drop-in vs SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    for r in rows:
        print(f"| {r['call']} | {r['batch']} | {r['heads_q']}/{r['heads_kv']} | {r['seq_len']} | "
              f"{r['head_dim']} | {'yes' if r['causal'] else 'no'} | {f(r['sage-8b_ms'])} | "
              f"{f(r['sdpa-cudnn_ms'])} | {f(r['sdpa-flash_ms'])} | {f(r['sdpa-default_ms'])} | "
              f"{f(r['sage_vs_sdpa'], '{:.2f}x')} | {r['choice']} | "
              f"{f(r['dropin_vs_sdpa'], '{:.2f}x')} | {f(r['dropin_vs_default'], '{:.2f}x')} |")
    from .bench import gpu_info
    name, driver = gpu_info()
    meta = {"bench": "models", "gpu": name, "driver": driver, "torch": torch.__version__,
            "dtype": args.dtype, "commit": args.commit,
            "date": datetime.date.today().isoformat(), "timing": "CUDA-graph replay, median"}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date']}-{gpu_slug(name)}-models.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
