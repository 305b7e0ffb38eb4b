"""python -m sage_attn.bench_flux: a whole model through the SDPA drop-in. The diffusers Flux.1
transformer (its published config: 19 double and 38 single blocks, 24 heads of 128; random
weights; bf16) runs one denoising step at 1024x1024 (4096 image + 512 text tokens):
  - sdpa:      torch's scaled_dot_product_attention, as diffusers calls it;
  - drop-in:   inside `sage_attn.sdpa()` (sage where its crossover model says it is faster);
  - sage-all:  the drop-in with its crossover off (sage on every call it takes).
GPU time under CUDA-graph replay, the three graphs replayed in turn over --rounds (medians), and
eager time with CUDA events; the speed of each against sdpa. Writes JSON to --out.

    python -m sage_attn.bench_flux --out bench/results
    python -m sage_attn.bench_flux --double 2 --single 4     # fewer blocks, the same shapes
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import statistics
import time

import sage_attn

from ._bench_common import cuda_missing, gpu_slug

try:
    import torch
except ImportError:  # --help works without torch; main() says it is needed
    torch = None

# FluxTransformer2DModel's arguments for FLUX.1-dev (black-forest-labs/FLUX.1-dev,
# transformer/config.json); --double and --single replace the block counts.
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])
# A few-parameter model of the same structure, for the CPU (tests, --tiny).
FLUX_TINY = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=[4, 4, 8])


def build(cfg, device, dtype):
    """The transformer built in `dtype` directly on `device` (at full size its fp32 weights would
    not fit beside the bf16 ones), with diffusers' own initialization."""
    from diffusers import FluxTransformer2DModel
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def inputs(cfg, n_img, n_txt, device, dtype, seed):
    """One step's inputs: a square latent of n_img tokens (its position ids on the grid), n_txt
    text tokens."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=g).to(device, dtype)

    side = int(round(n_img ** 0.5))
    grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side) * 1.0,
                                      torch.arange(side) * 1.0, indexing="ij"), -1)
    x = dict(hidden_states=rand(1, n_img, cfg["in_channels"]),
             encoder_hidden_states=rand(1, n_txt, cfg["joint_attention_dim"]),
             pooled_projections=rand(1, cfg["pooled_projection_dim"]),
             timestep=torch.rand(1, generator=g).to(device, dtype),
             img_ids=grid.reshape(-1, 3).to(device, dtype),
             txt_ids=torch.zeros(n_txt, 3, device=device, dtype=dtype), return_dict=False)
    if cfg.get("guidance_embeds"):
        x["guidance"] = torch.full((1,), 3.5, device=device, dtype=dtype)
    return x


@contextlib.contextmanager
def _crossover(enabled):
    sage_attn.set_dropin_crossover(enabled)
    try:
        yield
    finally:
        sage_attn.set_dropin_crossover(True)


def modes(model, x):
    """name -> a callable running one step that way."""
    def sdpa():
        return model(**x)[0]

    def dropin():
        with sage_attn.sdpa():
            return model(**x)[0]

    def sage_all():
        with _crossover(False), sage_attn.sdpa():
            return model(**x)[0]

    return {"sdpa": sdpa, "drop-in": dropin, "sage-all": sage_all}


def _cpu_ms(fn, seconds):
    fn()
    times, spent = [], 0.0
    while spent < seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return statistics.median(times) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--double", type=int, default=FLUX_DEV["num_layers"],
                    help="double-stream blocks (Flux.1: 19)")
    ap.add_argument("--single", type=int, default=FLUX_DEV["num_single_layers"],
                    help="single-stream blocks (Flux.1: 38)")
    ap.add_argument("--image-tokens", type=int, default=4096, help="1024x1024: 4096")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--seconds", type=float, default=2.0, help="timing target per mode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: eager wall time only (with --tiny: a check of the tool)")
    ap.add_argument("--tiny", action="store_true", help="a few-parameter model of Flux's shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    for name in ("double", "single", "image_tokens", "text_tokens", "rounds"):
        if getattr(a, name) < (0 if name in ("double", "single") else 1):
            ap.error(f"--{name.replace('_', '-')} = {getattr(a, name)} is out of range")
    if round(a.image_tokens ** 0.5) ** 2 != a.image_tokens:
        ap.error(f"--image-tokens = {a.image_tokens} is not a square number of latent patches")
    if a.device == "cuda" and cuda_missing("sage_attn.bench_flux", torch):
        return 2
    if torch is None:
        ap.error("python -m sage_attn.bench_flux needs PyTorch (import torch failed)")
    try:
        import diffusers
    except ImportError:
        print("python -m sage_attn.bench_flux needs diffusers (pip install diffusers)")
        return 2
    cfg = dict(FLUX_TINY if a.tiny else FLUX_DEV, num_layers=a.double, num_single_layers=a.single)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    model = build(cfg, a.device, dtype)
    x = inputs(cfg, a.image_tokens, a.text_tokens, a.device, dtype, a.seed)
    fns = modes(model, x)
    heads, d = cfg["num_attention_heads"], cfg["attention_head_dim"]
    n = a.image_tokens + a.text_tokens
    probe = torch.empty(1, heads, n, d, device=a.device, dtype=dtype)
    choice = sage_attn.dropin_backend(probe, probe, probe)
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}, diffusers {diffusers.__version__}, sage "
          f"{sage_attn.version()}, commit {a.commit}; Flux transformer {a.double} double + "
          f"{a.single} single blocks, {a.image_tokens} + {a.text_tokens} tokens, {a.dtype}; "
          f"the drop-in's choice for its attention ({heads} heads, N {n}, D {d}): {choice}",
          flush=True)
    rows = {name: {"mode": name} for name in fns}
    with torch.no_grad():
        if a.device == "cuda":
            from .bench import interleaved_ms, time_ms
            graph = interleaved_ms(fns, a.seconds, a.rounds,
                                   lambda msg: print(f"graph: {msg}", flush=True))
            for name, fn in fns.items():
                rows[name]["graph_ms"] = graph[name]
                rows[name]["eager_ms"] = time_ms(fn, a.seconds / 2)
        else:
            for name, fn in fns.items():
                rows[name]["graph_ms"] = None
                rows[name]["eager_ms"] = _cpu_ms(fn, a.seconds / 2)
    base = rows["sdpa"]
    print("\n| mode | graph ms | eager ms | vs sdpa (graph) | vs sdpa (eager) |")
    print("|---|---|---|---|---|")
    for r in rows.values():
        for col in ("graph", "eager"):
            mine, theirs = r[f"{col}_ms"], base[f"{col}_ms"]
            r[f"speed_{col}"] = theirs / mine if mine and theirs else None
        fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
        print(f"| {r['mode']} | {fmt(r['graph_ms'], '{:.2f}')} | {fmt(r['eager_ms'], '{:.2f}')} | "
              f"{fmt(r['speed_graph'], '{:.3f}x')} | {fmt(r['speed_eager'], '{:.3f}x')} |")
    if a.out:
        path = pathlib.Path(a.out) / f"{datetime.date.today()}-{gpu_slug(gpu)}-flux-model.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": gpu, "torch": torch.__version__, "diffusers": diffusers.__version__,
                "commit": a.commit, "date": str(datetime.date.today()), "config": cfg,
                "image_tokens": a.image_tokens, "text_tokens": a.text_tokens, "dtype": a.dtype,
                "dropin_choice": choice}
        path.write_text(json.dumps({"meta": meta, "rows": list(rows.values())}, indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
