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
    python -m sage_attn.bench_models --set more          # calls outside the README's table
    python -m sage_attn.bench_models --calls "mine:2:16:16:4096:4096:72:0;lm:1:32:8:2048:2048:128:1"

--calls takes your own calls, ';'-separated, each label:B:Hq:Hkv:Nq:Nk:D:causal (causal 0 or 1;
a causal call needs Nq = Nk).
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

# More calls (--set more), none of them among the shapes the crossover model was fitted to: other
# resolutions and sizes of the models above, cross-attention (Nq != Nk), other head dims and
# encoders. (model, call, B, Hq, Hkv, Nq, Nk, D, causal).
MORE_CALLS = (
    # Flux.1 at 768² (48² patches + 512 text), 1024x768 and 2048².
    ("flux", "flux.1 768² joint", 1, 24, 24, 2816, 2816, 128, False),
    ("flux", "flux.1 1024x768 joint", 1, 24, 24, 3584, 3584, 128, False),
    ("flux", "flux.1 2048² joint", 1, 24, 24, 16896, 16896, 128, False),
    # SD3.5 Medium (24 heads of 64) at 1024² and SD3 Medium at 512² (1024 + 333 tokens).
    ("sd3.5", "sd3.5-medium 1024² joint", 2, 24, 24, 4429, 4429, 64, False),
    ("sd3.5", "sd3-medium 512² joint", 2, 24, 24, 1357, 1357, 64, False),
    # SDXL at 768² (96² latent): self-attention at 48² and 24²; its first level's cross-attention
    # to 77 text tokens at 1024². SD 1.5's first level's cross-attention.
    ("sdxl", "sdxl 768² level 1", 2, 10, 10, 2304, 2304, 64, False),
    ("sdxl", "sdxl 768² level 2", 2, 20, 20, 576, 576, 64, False),
    ("sdxl", "sdxl 1024² level 1 cross", 2, 10, 10, 4096, 77, 64, False),
    ("sd1.5", "sd1.5 512² level 1 cross", 2, 8, 8, 4096, 77, 40, False),
    # PixArt-Σ at 2048² (128² patches) and its cross-attention to 300 T5 tokens at 1024².
    ("pixart", "pixart-sigma 2048²", 2, 16, 16, 16384, 16384, 72, False),
    ("pixart", "pixart-sigma 1024² cross", 2, 16, 16, 4096, 300, 72, False),
    # Hunyuan-DiT at 1024²: 64² patches, 16 heads of 88.
    ("hunyuan-dit", "hunyuan-dit 1024²", 2, 16, 16, 4096, 4096, 88, False),
    # Video: Wan 2.1 1.3B at 480p (12 heads), 14B at 720p (21 latent frames of 45x80), its
    # cross-attention to 512 text tokens; CogVideoX-2B (30 heads); HunyuanVideo at 544x960x129;
    # LTX-Video at 704x1216x121 (16 latent frames of 22x38).
    ("wan", "wan2.1-1.3b 480p", 1, 12, 12, 32760, 32760, 128, False),
    ("wan", "wan2.1-14b 720p", 1, 40, 40, 75600, 75600, 128, False),
    ("wan", "wan2.1-14b 480p cross", 1, 40, 40, 32760, 512, 128, False),
    ("cogvideox", "cogvideox-2b", 2, 30, 30, 17776, 17776, 64, False),
    ("hunyuan", "hunyuanvideo 544p", 1, 24, 24, 67576, 67576, 128, False),
    ("ltx", "ltx-video 704x1216x121", 2, 32, 32, 13376, 13376, 64, False),
    # LLM prefill: Llama 3.2 1B (D 64) and 3B, a batch of four 2k prompts on Llama 3 8B, Qwen2.5
    # 0.5B (14 heads of 64 over 2) and 72B, Gemma 2 9B (D 256), Phi-3 mini (D 96).
    ("llama3.2-1b", "llama3.2-1b prefill 2k", 1, 32, 8, 2048, 2048, 64, True),
    ("llama3.2-1b", "llama3.2-1b prefill 8k", 1, 32, 8, 8192, 8192, 64, True),
    ("llama3.2-3b", "llama3.2-3b prefill 4k", 1, 24, 8, 4096, 4096, 128, True),
    ("llama3-8b", "llama3-8b prefill 4x2k", 4, 32, 8, 2048, 2048, 128, True),
    ("qwen2.5-0.5b", "qwen2.5-0.5b prefill 4k", 1, 14, 2, 4096, 4096, 64, True),
    ("qwen2.5-0.5b", "qwen2.5-0.5b prefill 32k", 1, 14, 2, 32768, 32768, 64, True),
    ("qwen2.5-72b", "qwen2.5-72b prefill 8k", 1, 64, 8, 8192, 8192, 128, True),
    ("gemma2-9b", "gemma2-9b prefill 8k", 1, 16, 8, 8192, 8192, 256, True),
    ("phi3-mini", "phi-3-mini prefill 4k", 1, 32, 32, 4096, 4096, 96, True),
    # Encoders: ViT-H/14 224² (16 heads of 80), DINOv2-L/14 at 518², CLIP ViT-L/14 at 336²,
    # Whisper large-v3's encoder (30 s: 1500 frames, 20 heads of 64), BERT-base at 512 tokens.
    ("vit", "vit-h/14 224²", 32, 16, 16, 257, 257, 80, False),
    ("dinov2", "dinov2-l/14 518²", 8, 16, 16, 1370, 1370, 64, False),
    ("clip", "clip vit-l/14 336²", 32, 16, 16, 577, 577, 64, False),
    ("whisper", "whisper-large-v3 encoder", 8, 20, 20, 1500, 1500, 64, False),
    ("bert", "bert-base 512", 32, 12, 12, 512, 512, 64, False),
)


def _table(name):
    """The calls of --set NAME as (model, call, B, Hq, Hkv, Nq, Nk, D, causal)."""
    table = tuple((m, c, b, hq, hkv, n, n, d, causal) for m, c, b, hq, hkv, n, d, causal in MODELS)
    return {"table": table, "more": MORE_CALLS, "all": table + MORE_CALLS}[name]


def parse_calls(text):
    """--calls: 'label:B:Hq:Hkv:Nq:Nk:D:causal' items separated by ';' -> call tuples."""
    calls = []
    for item in (x.strip() for x in text.split(";")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 8:
            raise ValueError(f"--calls: {item!r} is not label:B:Hq:Hkv:Nq:Nk:D:causal")
        label = parts[0]
        try:
            b, hq, hkv, nq, nk, d, c = (int(x) for x in parts[1:])
        except ValueError:
            raise ValueError(f"--calls: {item!r}: B, Hq, Hkv, Nq, Nk, D and causal are integers")
        if min(b, hq, hkv, nq, nk, d) < 1 or hq % hkv or c not in (0, 1) or (c and nq != nk):
            raise ValueError(f"--calls: {item!r}: sizes >= 1, Hq a multiple of Hkv, causal 0 or 1 "
                             "(and Nq = Nk when causal)")
        calls.append((label, label, b, hq, hkv, nq, nk, d, bool(c)))
    return tuple(calls)


def _flops(b, h, nq, nk, d, causal):
    return 4.0 * b * h * nq * nk * d / (2 if causal else 1)


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
    ap.add_argument("--set", default="table", choices=["table", "more", "all"],
                    help="the README's table (default), the calls outside it, or both")
    ap.add_argument("--calls", default="",
                    help="your own calls instead: label:B:Hq:Hkv:Nq:Nk:D:causal;...")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--seconds", type=float, default=0.25, help="timing target per figure")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds the implementations' graphs are replayed in turn (median)")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    try:
        calls = parse_calls(args.calls) if args.calls else _table(args.set)
    except ValueError as e:
        ap.error(str(e))
    if cuda_missing("sage_attn.bench_models", torch):
        return 2
    from .bench import interleaved_ms
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model, call, b, hq, hkv, n, nk, d, causal in calls:
        if only and model not in only:
            continue
        q = torch.randn((b, hq, n, d), generator=gen, device="cuda", dtype=dtype)
        k = torch.randn((b, hkv, nk, d), generator=gen, device="cuda", dtype=dtype)
        v = torch.randn((b, hkv, nk, d), generator=gen, device="cuda", dtype=dtype)
        row = {"model": model, "call": call, "batch": b, "heads_q": hq, "heads_kv": hkv,
               "seq_len": n, "seq_len_kv": nk, "head_dim": d, "causal": causal,
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
        row["tops_sage"] = _flops(b, hq, n, nk, d, causal) / row["sage-8b_ms"] / 1e9 \
            if row["sage-8b_ms"] else None
        rows.append(row)
        nkv = "" if nk == n else f"/{nk}"
        print(f"{call:28s} B={b:<3d} H={hq:<3d}/{hkv:<3d} N={n}{nkv:<7s} D={d:<4d} "
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
        nkv = "" if r["seq_len_kv"] == r["seq_len"] else f"/{r['seq_len_kv']}"
        print(f"| {r['call']} | {r['batch']} | {r['heads_q']}/{r['heads_kv']} | {r['seq_len']}{nkv} | "
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
    tag = "calls" if args.calls else "models" if args.set == "table" else f"models-{args.set}"
    if args.dtype != "fp16":
        tag += "-" + args.dtype
    path = out / f"{meta['date']}-{gpu_slug(name)}-{tag}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
