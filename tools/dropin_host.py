"""tools/dropin_host.py: the SDPA drop-in's own host time, on any machine (no GPU needed).

    python tools/dropin_host.py [--calls 2000] [--repeats 9]

The Python that sage_attn.scaled_dot_product_attention runs around the work it hands on (its
argument checks, its routing, the sage call's preparation) is timed on CPU tensors made to look
like CUDA ones (cuda_stand_in): every piece that would reach a GPU is replaced by a stand-in that
does nothing (torch's SDPA returns its query, the library's run returns at once, its plan says
what the stand-in is told). So a drop-in call's time here is its own host time plus one trivial
call, and the same trivial call timed alone is subtracted. Per shape, three calls: handed to
torch by the crossover model at the GPU's least routed length (the signature and its lookup),
shorter than that length (the shortcut), and run with sage (the signature, the direct launch).
The sage route's figure includes the allocation of its output and workspace by the CPU
allocator (on a GPU torch's caching allocator serves them), not the library's C call.

On a GPU, `python -m sage_attn.bench --host-time` measures the real calls against torch's SDPA.

tests/python/test_dropin_cache.py uses cuda_stand_in to check the drop-in's routing on CPU
tensors. An experiment of the repository (like tools/crossover.py), not a module of the package.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (name, B, H, N, D): ViT-L/14 at 224² (257 tokens), DiT-XL/2 at 256² (256 tokens, 72-wide
# heads), Flux.1 at 1024² (4096 image + 512 text tokens).
SHAPES = (("vit-l 224", 1, 16, 257, 64), ("vit-l 224", 8, 16, 257, 64),
          ("dit-xl/2 256", 2, 16, 256, 72), ("flux.1 1024", 1, 24, 4608, 128))


class Stand:
    """What the stand-ins saw (plans made, the library's runs and the argument struct of the
    last, torch SDPA calls), and what the plan stand-in answers: prefer_sdpa,
    prefer_sdpa_training, has_backward, workspace, sdpa_below, each a value or a function of the
    library's argument struct (an answer that depends on the call)."""

    def __init__(self, prefer_sdpa, prefer_sdpa_training, has_backward, workspace, sdpa_below=0):
        self.prefer_sdpa, self.prefer_sdpa_training = prefer_sdpa, prefer_sdpa_training
        self.has_backward, self.workspace = has_backward, workspace
        self.sdpa_below = sdpa_below
        self.plans = self.runs = self.sdpa = 0
        self.last_run = None


@contextlib.contextmanager
def cuda_stand_in(prefer_sdpa=False, prefer_sdpa_training=True, has_backward=True,
                  workspace=256, sdpa_below=0):
    """CPU tensors pass for CUDA tensors in sage_attn's torch front end for the length of the
    block: torch.Tensor.is_cuda reads True, the CUDA device and stream calls return stand-ins,
    the library's plan answers what the arguments say (Stand), its run records its arguments
    and does nothing, and torch's SDPA (as the drop-in calls it) returns its query. The front
    end's plans and routes start empty and are put back after. Yields the Stand. For timing and
    tests only: anything else that asks a CPU tensor is_cuda in the block is told True too."""
    import torch
    from sage_attn import _lib, _torch as T

    stand = Stand(prefer_sdpa, prefer_sdpa_training, has_backward, workspace, sdpa_below)

    def plan(args):
        stand.plans += 1
        info = _lib.PlanInfo()
        for field, answer in (("workspace_size", stand.workspace),
                              ("prefer_sdpa", stand.prefer_sdpa),
                              ("prefer_sdpa_training", stand.prefer_sdpa_training),
                              ("has_backward", stand.has_backward),
                              ("sdpa_below", stand.sdpa_below)):
            setattr(info, field, answer(args) if callable(answer) else answer)
        return info

    def run(args):
        stand.runs += 1
        stand.last_run = args

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        stand.sdpa += 1
        return query

    saved = [(torch.cuda, "current_device"), (torch.cuda, "device"), (T, "_current_stream"),
             (T, "_torch_sdpa"), (_lib, "plan"), (_lib, "run"), (T, "_prepared"),
             (T, "_routes"), (T, "_sdpa_below")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    torch.cuda.current_device = lambda: None  # (a CPU tensor's device index)
    torch.cuda.device = lambda device: contextlib.nullcontext()
    T._current_stream = lambda device: 1
    T._torch_sdpa = sdpa
    _lib.plan, _lib.run = plan, run
    # (Plans and routes decided outside the block are the real library's, and vice versa.)
    T._prepared, T._routes, T._sdpa_below = {}, {}, {}
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield stand
    finally:
        del torch.Tensor.is_cuda
        for owner, name, value in saved:
            setattr(owner, name, value)


def per_call_us(fn, calls, repeats):
    """Median over `repeats` batches of one batch's wall time over its `calls` calls."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="calls a batch (default 2000)")
    ap.add_argument("--repeats", type=int, default=9, help="batches, median (default 9)")
    args = ap.parse_args(argv)
    if args.calls <= 0 or args.repeats <= 0:
        ap.error("--calls and --repeats must be positive")
    try:
        import sage_attn
    except ImportError:  # a source checkout without the package installed
        sys.path.insert(0, str(ROOT / "python"))
        import sage_attn
    import torch
    from sage_attn import _torch as T

    print(f"torch {torch.__version__}, sage {sage_attn.version()}; the drop-in's Python on CPU "
          "stand-ins, microseconds per call (median of batches)")
    print(f"{'call':13s} {'B':>2s} {'H':>3s} {'N':>5s} {'D':>4s} | {'trivial':>7s} | "
          f"{'to torch':>8s} {'own':>6s} | {'short':>7s} {'own':>6s} | {'to sage':>7s} "
          f"{'own':>6s}")
    for name, b, h, n, d in SHAPES:
        q, k, v = (torch.randn((b, h, n, d), dtype=torch.float16) for _ in range(3))
        row = {}
        # (The plan's least routed length, sdpa_below: short, the call under it (torch's
        # without its signature); torch and sage, the call at it (the shortcut's test runs and
        # lets it through), where the crossover model answers torch or sage.)
        for route, prefer, below in (("torch", True, n), ("short", True, n + 1),
                                     ("sage", False, n)):
            with cuda_stand_in(prefer_sdpa=prefer, sdpa_below=below) as stand:
                dropin = sage_attn.scaled_dot_product_attention
                sdpa = T._torch_sdpa
                row["trivial"] = per_call_us(lambda: sdpa(q, k, v, is_causal=False, scale=None,
                                                          enable_gqa=False),
                                             args.calls, args.repeats)
                row[route] = per_call_us(lambda: dropin(q, k, v), args.calls, args.repeats)
                ran = stand.runs if route == "sage" else stand.sdpa
                if ran == 0:  # the stand-in's answer did not take the route it names
                    raise SystemExit(f"{name}: the drop-in did not route to {route}")
        print(f"{name:13s} {b:2d} {h:3d} {n:5d} {d:4d} | {row['trivial']:7.2f} | "
              f"{row['torch']:8.2f} {row['torch'] - row['trivial']:6.2f} | "
              f"{row['short']:7.2f} {row['short'] - row['trivial']:6.2f} | "
              f"{row['sage']:7.2f} {row['sage'] - row['trivial']:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
