"""tools/train_parity.py: does a small GPT train the same with SageBwd as with torch's
SDPA in bf16? A pre-norm GPT is pretrained from scratch with SDPA (seeds 0 .. n-1, --sdpa-seeds)
and with sage (seed 0), then fine-tuned from one shared checkpoint (the SDPA seed-0 pretrained
weights, a fresh optimizer) with SDPA (the same seeds) and with sage (seed 0).

    python tools/train_parity.py --out bench/results    # about 2 min on an H100 (estimated)
    python tools/train_parity.py --smoke --out /tmp/tp  # tiny, runs on CPU tensors

An experiment of the repository, not a part of the package users import: it needs sage_attn
importable (installed, or a source checkout's python/ directory, which it falls back to).

Data: the bytes (vocab 256) of the running Python's standard library `.py` files
(sysconfig's "stdlib" path; site-packages and dist-packages excluded), each followed by a 0 byte,
files in sorted path order. The `test/` package (the stdlib's regression tests) is the
fine-tuning slice; the other files are the pretraining slice. In each slice every 20th file
(index % 20 == 0) is held out for validation. Training batches are random windows of the slice's
training text, their offsets drawn from a generator seeded with the run's seed, which also seeds
the initialization (so sage seed 0 sees SDPA seed 0's initial weights and batches; in
fine-tuning the seed only orders the batches). Validation uses --val-seqs fixed, evenly spaced
windows of the held-out text, evaluated with the run's own attention at step 0 and at
--val-points evenly spaced steps up to the last.

Model: GPT with pre-LayerNorm blocks, learned positions, tied input/output embeddings, GELU MLP
(4x), no biases, no dropout. Defaults: 6 layers, d_model 512, 8 heads (D = 64), context 2048,
~19M parameters. Precision: fp32 parameters and optimizer state, bf16 autocast (q, k, v reach the
attention as bf16 [B, H, N, D]). AdamW (0.9, 0.95), weight decay 0.1 on matrices, linear warmup
then cosine to 10% of the peak, gradient clipping at 1.0. Attention: `sdpa` is
F.scaled_dot_product_attention(q, k, v, is_causal=True) (torch's choice of backend); `sage` is
sage_attn.sageattn(q, k, v, is_causal=True) (SageAttn2-8b forward, SageBwd backward on CUDA; the
CPU reference's emulation on CPU tensors; with Nq = Nk both causal alignments are the same mask).

Verdict (the issue's done-when), from the validation losses of --sdpa-seeds SDPA runs (n, seeds
0 .. n-1) and one sage run (seed 0) per phase:
- pretraining, "within the seeds' spread": the sage run's final validation loss lies in the 95%
  prediction interval of the SDPA seeds' final losses, mean ± t(0.975, n-1)·s·sqrt(1 + 1/n) (s
  their sample standard deviation): where one more SDPA seed would land 19 times in 20. (Lying
  between two seeds' values, the rule this replaces, happens to a third seed of the same
  distribution only one time in three.) Also reported: the range [min, max] of the seeds and
  (sage - mean) / (max - min).
- fine-tuning, "the curves overlap": at no validation point (step 0 included) does the sage curve
  depart from the SDPA seed-0 curve (same checkpoint, same batches) by more than the largest gap
  between another SDPA seed's curve and seed 0's: max_t |sage(t) - sdpa0(t)| <= max_{j,t}
  |sdpa_j(t) - sdpa0(t)|.
Both rules are computed for both phases; `pass` is pretraining within the prediction interval and
fine-tuning overlap. The final train loss (mean of the last 10% of steps) is reported, not
judged.

Time: on CUDA a short calibration times a few training steps of each attention first; when the
runs' estimate exceeds 90% of what is left of --budget-s (counted from this module's import),
every run's steps shrink by one factor (recorded as steps_scale, with steps_requested).
--budget-s 0 turns that off. Writes <date>-<gpu>-train-parity.json (config, data, per-step train
losses and gradient norms, validation points, final losses, timings, verdict) and a PNG of the
loss curves (smoothed train loss and validation points, each phase whole and its last 40%) to
--out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import sage_attn
except ImportError:  # run from a source checkout: the package is python/sage_attn
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
    import sage_attn

_T0 = time.perf_counter()
EOF_BYTE = b"\0"


# --- data ----------------------------------------------------------------------------------------
def load_corpus(stdlib=None, val_every=20):
    """The four byte streams (pretrain/finetune x train/val) and their file and token counts."""
    root = pathlib.Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py")
                    if p.is_file() and not {"site-packages", "dist-packages"} & set(p.parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    slices = {"pretrain": [], "finetune": []}
    for p in files:
        rel = p.relative_to(root).parts
        slices["finetune" if len(rel) > 1 and rel[0] == "test" else "pretrain"].append(p)
    streams, counts = {}, {}
    for name, paths in slices.items():
        for part in ("train", "val"):
            chosen = [p for i, p in enumerate(paths) if (i % val_every == 0) == (part == "val")]
            data = b"".join(p.read_bytes() + EOF_BYTE for p in chosen)
            streams[f"{name}_{part}"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            counts[f"{name}_{part}"] = {"files": len(chosen), "tokens": len(data)}
    return streams, {"stdlib": str(root), "python": platform.python_version(),
                     "split": "the test/ package: finetune, the other files: pretrain; "
                              f"every {val_every}th file of each (sorted paths): val",
                     "slices": counts}


def val_windows(stream, n_seqs, context):
    """n_seqs fixed windows of context + 1 tokens, evenly spaced over the held-out stream."""
    last = len(stream) - context - 1
    if last < 0:
        raise SystemExit(f"validation text of {len(stream)} tokens is shorter than the context")
    starts = torch.linspace(0, last, n_seqs).long()
    return torch.stack([stream[s:s + context + 1] for s in starts.tolist()]).long()


# --- model ---------------------------------------------------------------------------------------
def attention_fn(name):
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if name == "sage":  # (sageattn itself, not the drop-in, which trains with torch's SDPA)
        return lambda q, k, v: sage_attn.sageattn(q, k, v, is_causal=True)
    raise ValueError(f"attention {name!r}: must be sdpa or sage")


class Block(nn.Module):
    def __init__(self, d_model, heads, attn):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.out = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, c // self.heads)
        # [B, H, N, D] each, made contiguous for both attentions: SageBwd's GPU tests cover
        # contiguous HND/NHD layouts, not the token stride of 3·d_model a fused QKV gives.
        q, k, v = (t.contiguous() for t in qkv.permute(2, 0, 3, 1, 4).unbind(0))
        x = x + self.proj(self.attn(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg, attn):
        super().__init__()
        d = cfg["d_model"]
        self.wte = nn.Embedding(256, d)
        self.wpe = nn.Embedding(cfg["context"], d)
        self.blocks = nn.ModuleList(Block(d, cfg["heads"], attention_fn(attn))
                                    for _ in range(cfg["layers"]))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init: residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * cfg["layers"]) if name.endswith(("proj.weight",
                                                                            "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe.weight[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied embeddings
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# --- training ------------------------------------------------------------------------------------
def lr_at(step, steps, peak, warmup_frac):
    warmup = max(1, round(warmup_frac * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model, lr, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                             fused=device.type == "cuda")


def train_step(model, opt, batch, lr, device):
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), gnorm.detach()


@torch.no_grad()
def evaluate(model, windows, batch, device):
    total = torch.zeros((), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for i in range(0, len(windows), batch):
            w = windows[i:i + batch]
            total += model(w[:, :-1], w[:, 1:]).float() * len(w)
    return float(total) / len(windows)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def batch_offsets(seed, steps, batch, n_tokens, context):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - context - 1, (steps, batch), generator=g)


def run(phase, attn, seed, cfg, a, train, val, device, init_state=None, log=print):
    """One training run: its record (losses, validation points, timings) and trained weights."""
    steps = a.steps if phase == "pretrain" else a.ft_steps
    peak = a.lr if phase == "pretrain" else a.ft_lr
    torch.manual_seed(seed)
    model = GPT(cfg, attn)  # initialized on the CPU: the same weights on any device
    if init_state is not None:
        model.load_state_dict(init_state)
    model.to(device).train()
    opt = make_optimizer(model, peak, device)
    offsets = batch_offsets(seed, steps, a.batch, len(train), cfg["context"]).to(device)
    span = torch.arange(cfg["context"] + 1, device=device)
    val_at = {round(i * steps / a.val_points) for i in range(a.val_points + 1)}
    losses = torch.zeros(steps, device=device)
    gnorms = torch.zeros(steps, device=device)
    # Backward calls SageBwd's accuracy check sent to 16 bits, per step (sage runs; the counter
    # is the package's, so a step's share is read around it).
    fallbacks = []
    record = {"phase": phase, "attention": attn, "seed": seed, "steps": steps, "val": []}
    tag = f"[{phase} {attn} seed {seed}]"
    sync(device)
    start, eval_s = time.perf_counter(), 0.0
    for step in range(steps + 1):
        if step in val_at:
            sync(device)
            t = time.perf_counter()
            model.eval()
            record["val"].append([step, evaluate(model, val, a.batch, device)])
            model.train()
            eval_s += time.perf_counter() - t
            done = losses[max(0, step - 10):step]
            recent = f"train {float(done.mean()):.4f}" if step else "train -"
            log(f"{tag} step {step}/{steps}  {recent}  val {record['val'][-1][1]:.4f}  "
                f"{time.perf_counter() - start:.1f} s")
            if step and not math.isfinite(float(done.mean())):
                log(f"{tag} non-finite loss: stopping this run")
                record["stopped_at"] = step
                break
        if step == steps:
            break
        batch = train[offsets[step, :, None] + span].long()
        before = sage_attn.backward_fallbacks()
        losses[step], gnorms[step] = train_step(model, opt, batch, lr_at(step, steps, peak,
                                                                         a.warmup_frac), device)
        fallbacks.append(sage_attn.backward_fallbacks() - before)
    sync(device)
    seconds = time.perf_counter() - start
    record["train_loss"] = [round(x, 5) for x in losses.tolist()]
    record["grad_norm"] = [round(x, 5) for x in gnorms.tolist()]
    tail = record["train_loss"][-max(1, steps // 10):]
    record["final_val_loss"] = record["val"][-1][1]
    record["final_train_loss"] = sum(tail) / len(tail)
    record["finite"] = all(math.isfinite(x) for x in record["train_loss"] + [
        v for _, v in record["val"]])
    record["seconds"] = seconds
    record["eval_seconds"] = eval_s
    record["train_ms_per_step"] = 1000 * (seconds - eval_s) / steps
    # Of the steps x layers backward calls, how many the check sent to 16 bits (0 for SDPA).
    record["backward_calls"] = len(fallbacks) * cfg["layers"]
    record["backward_16bit"] = sum(fallbacks)
    record["backward_16bit_per_step"] = fallbacks
    log(f"{tag} done: final val {record['final_val_loss']:.4f}, train (last 10%) "
        f"{record['final_train_loss']:.4f}, {seconds:.1f} s "
        f"({record['train_ms_per_step']:.1f} ms/step), backward calls in 16 bits "
        f"{record['backward_16bit']} of {record['backward_calls']}")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return record, state


def calibrate(cfg, a, train, device, attns, n=4):
    """ms per training step of each attention at the run's shapes (a throwaway model)."""
    ms = {}
    offsets = batch_offsets(12345, n + 2, a.batch, len(train), cfg["context"]).to(device)
    span = torch.arange(cfg["context"] + 1, device=device)
    for attn in attns:
        torch.manual_seed(12345)
        model = GPT(cfg, attn).to(device)
        opt = make_optimizer(model, a.lr, device)
        for i in range(n + 2):
            if i == 2:
                sync(device)
                t = time.perf_counter()
            train_step(model, opt, train[offsets[i, :, None] + span].long(), 1e-4, device)
        sync(device)
        ms[attn] = 1000 * (time.perf_counter() - t) / n
        del model, opt
    return ms


def attention_check(cfg, a, device, gen_seed=0):
    """sage against SDPA on one layer's shapes (N(0,1) bf16 q, k, v, dO): cosine similarity and
    relative L1 of O, dQ, dK, dV, so that a broken kernel is told apart from training noise."""
    g = torch.Generator().manual_seed(gen_seed)
    shape = (min(a.batch, 2), cfg["heads"], cfg["context"], cfg["head_dim"])
    q, k, v, d_o = (torch.randn(shape, generator=g).to(device, torch.bfloat16) for _ in range(4))
    out = {}
    for name in ("sdpa", "sage"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = attention_fn(name)(qq, kk, vv)
        o.backward(d_o)
        out[name] = [x.detach().double().flatten() for x in (o, qq.grad, kk.grad, vv.grad)]
    check = {}
    for label, x, ref in zip(("o", "dq", "dk", "dv"), out["sage"], out["sdpa"]):
        check[label] = {"cos": float(x @ ref / (x.norm() * ref.norm())),
                        "rel_l1": float((x - ref).abs().sum() / ref.abs().sum())}
    return check


def fit_budget(a, ms, left):
    """(steps, ft_steps, scale, estimate in s) for the runs (--sdpa-seeds SDPA and one sage per
    phase) at ms per training step, scaled down by one factor to fit 90% of `left` seconds."""
    round_ms = a.sdpa_seeds * ms["sdpa"] + ms["sage"]  # one step of each run of a phase
    eval_s = 2 * (a.val_points + 1) * math.ceil(a.val_seqs / a.batch) * round_ms / 3 / 1000
    train_s = (a.steps + a.ft_steps) * round_ms / 1000
    if train_s + eval_s <= 0.9 * left:
        return a.steps, a.ft_steps, 1.0, train_s + eval_s
    scale = max(0.05, (0.9 * left - eval_s) / train_s)
    return (max(20, int(a.steps * scale)), max(10, int(a.ft_steps * scale)), scale,
            train_s + eval_s)


# --- verdict -------------------------------------------------------------------------------------
# Student's t, the 0.975 quantile, by degrees of freedom (1 .. 9): the prediction interval's.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def compare(runs, phase):
    """The two rules of the module docstring for one phase (runs: its SDPA seeds 0 .. n-1 and
    sage seed 0)."""
    mine = [r for r in runs if r["phase"] == phase]
    sdpa = sorted((r for r in mine if r["attention"] == "sdpa"), key=lambda r: r["seed"])
    sage = next(r for r in mine if r["attention"] == "sage" and r["seed"] == 0)
    finals = [r["final_val_loss"] for r in sdpa]
    fs, n = sage["final_val_loss"], len(finals)
    mean = sum(finals) / n
    std = math.sqrt(sum((f - mean) ** 2 for f in finals) / (n - 1))
    half = T975[n - 2] * std * math.sqrt(1 + 1 / n)
    spread = max(finals) - min(finals)
    curve = lambda r: dict(r["val"])  # noqa: E731
    c0, cs, others = curve(sdpa[0]), curve(sage), [curve(r) for r in sdpa[1:]]
    common = sorted(set(c0).intersection(cs, *others))
    noise = max((abs(c[t] - c0[t]) for c in others for t in common), default=float("nan"))
    gap = max((abs(cs[t] - c0[t]) for t in common), default=float("nan"))
    finite = all(r["finite"] for r in sdpa) and sage["finite"]
    return {"sdpa_finals": finals, "sdpa_mean": mean, "sdpa_std": std, "sage_seed0": fs,
            "sdpa_seed0": finals[0], "sdpa_seed1": finals[1],
            "prediction_half_width": half,
            "within_prediction": finite and abs(fs - mean) <= half,
            "spread": spread, "within_spread": finite and min(finals) <= fs <= max(finals),
            "diff_in_spreads": (fs - mean) / spread if spread > 0 else None,
            "curve_noise": noise, "curve_gap": gap, "val_points": common,
            "curves_overlap": finite and gap <= noise}


# --- command line --------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny configuration (2 layers, d_model 64, context 128, a few steps)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--steps", type=int, default=600, help="pretraining steps")
    ap.add_argument("--ft-steps", type=int, default=200, help="fine-tuning steps")
    ap.add_argument("--lr", type=float, default=2e-3, help="pretraining peak learning rate")
    ap.add_argument("--ft-lr", type=float, default=3e-4, help="fine-tuning peak learning rate")
    ap.add_argument("--warmup-frac", type=float, default=0.05)
    ap.add_argument("--val-seqs", type=int, default=64, help="fixed validation windows")
    ap.add_argument("--val-points", type=int, default=12, help="validations after step 0")
    ap.add_argument("--sdpa-seeds", type=int, default=4,
                    help="SDPA runs per phase (2 to 10): the spread sage is judged against")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="wall-clock budget on CUDA; steps shrink to fit (0: off)")
    ap.add_argument("--stdlib", default=None, help="text source (default: sysconfig's stdlib)")
    ap.add_argument("--no-backward-retry", action="store_true",
                    help="try SageBwd's 8 bits on every backward call (sage_attn."
                         "set_backward_retry(False)); by default a kind of call the check "
                         "keeps refusing goes straight to 16 bits for a while")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.smoke:
        for k, v in dict(layers=2, d_model=64, heads=2, context=128, batch=4, steps=8,
                         ft_steps=4, lr=3e-3, ft_lr=1e-3, val_seqs=4, val_points=2,
                         sdpa_seeds=3).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    for k in ("layers", "d_model", "heads", "context", "batch", "steps", "ft_steps", "val_seqs",
              "val_points"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be at least 1")
    if not 2 <= a.sdpa_seeds <= 10:
        ap.error("--sdpa-seeds must be 2 to 10")
    if a.d_model % a.heads:
        ap.error("--d-model must be a multiple of --heads")
    return a


def main(argv=None):
    a = parse_args(argv)
    sage_attn.set_backward_retry(not a.no_backward_retry)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    cfg = {"layers": a.layers, "d_model": a.d_model, "heads": a.heads,
           "head_dim": a.d_model // a.heads, "context": a.context}
    streams, data_info = load_corpus(a.stdlib)
    log(f"data: {json.dumps(data_info['slices'])} ({time.perf_counter() - _T0:.1f} s)")
    streams = {k: v.to(device) for k, v in streams.items()}
    val = {p: val_windows(streams[f"{p}_val"], a.val_seqs, a.context)
           for p in ("pretrain", "finetune")}
    cfg["parameters"] = sum(p.numel() for p in GPT(cfg, "sdpa").parameters())
    check = attention_check(cfg, a, device)
    log("sage against SDPA on one layer's shapes (bf16 N(0,1)): " + ", ".join(
        f"{k} cos {v['cos']:.5f} rel-L1 {v['rel_l1']:.4f}" for k, v in check.items()))
    steps_requested = (a.steps, a.ft_steps)
    scale = 1.0
    if device.type == "cuda" and a.budget_s > 0:
        ms = calibrate(cfg, a, streams["pretrain_train"], device, ("sdpa", "sage"))
        left = a.budget_s - (time.perf_counter() - _T0)
        steps, ft_steps, scale, est = fit_budget(a, ms, left)
        log(f"calibration: {ms['sdpa']:.1f} ms/step sdpa, {ms['sage']:.1f} ms/step sage; "
            f"estimate {est:.0f} s for the runs, {left:.0f} s of the budget left")
        if scale < 1:
            log(f"over budget: steps scaled by {scale:.2f} to {steps} and {ft_steps}")
            a.steps, a.ft_steps = steps, ft_steps
    runs = []
    pretrained = None
    order = [("sdpa", s) for s in range(a.sdpa_seeds)] + [("sage", 0)]
    for attn, seed in order:
        rec, state = run("pretrain", attn, seed, cfg, a, streams["pretrain_train"],
                         val["pretrain"], device, log=log)
        runs.append(rec)
        if (attn, seed) == ("sdpa", 0):
            pretrained = state
    for attn, seed in order:
        rec, _ = run("finetune", attn, seed, cfg, a, streams["finetune_train"], val["finetune"],
                     device, init_state=pretrained, log=log)
        runs.append(rec)
    pre, ft = compare(runs, "pretrain"), compare(runs, "finetune")
    verdict = {"pretrain": pre, "finetune": ft,
               "pass": pre["within_prediction"] and ft["curves_overlap"],
               "rule": "pass = pretraining: sage's final val loss within the SDPA seeds' 95% "
                       "prediction interval, mean +- t(0.975, n-1) s sqrt(1 + 1/n); fine-tuning: "
                       "max_t |sage - sdpa0| <= max_{j,t} |sdpa_j - sdpa0| over the validation "
                       "points"}
    wall = time.perf_counter() - _T0
    for name, c in (("pretraining", pre), ("fine-tuning", ft)):
        log(f"{name}: final val sdpa " + " / ".join(f"{f:.4f}" for f in c["sdpa_finals"]) +
            f", sage {c['sage_seed0']:.4f} (sage - mean {c['sage_seed0'] - c['sdpa_mean']:+.4f}, "
            f"95% prediction ±{c['prediction_half_width']:.4f}: {c['within_prediction']}); "
            f"curve gap {c['curve_gap']:.4f} vs seed noise {c['curve_noise']:.4f} "
            f"(overlap: {c['curves_overlap']})")
    log(f"verdict: {'PASS' if verdict['pass'] else 'FAIL'} ({wall:.0f} s)")
    if a.out:
        gpu = (torch.cuda.get_device_name(device).replace(" ", "-").lower()
               if device.type == "cuda" else "cpu")
        short = gpu.split("-")[1] if "-" in gpu else gpu
        path = pathlib.Path(a.out) / f"{datetime.date.today()}-{short}-train-parity.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "python": sys.version.split()[0],
                "commit": a.commit, "date": str(datetime.date.today()), "wall_s": wall,
                "argv": sys.argv[1:] if argv is None else list(argv)}
        config = {"model": cfg, "smoke": a.smoke, "batch": a.batch, "steps": a.steps,
                  "ft_steps": a.ft_steps, "steps_requested": list(steps_requested),
                  "steps_scale": scale, "lr": a.lr, "ft_lr": a.ft_lr,
                  "warmup_frac": a.warmup_frac, "lr_schedule": "linear warmup, cosine to 10%",
                  "optimizer": "AdamW betas (0.9, 0.95), weight decay 0.1 on matrices, "
                               "grad clip 1.0",
                  "precision": "fp32 parameters and optimizer state, bf16 autocast",
                  "backward_retry": not a.no_backward_retry,
                  "val_seqs": a.val_seqs, "val_points": a.val_points,
                  "positions": "learned", "embeddings": "tied"}
        path.write_text(json.dumps({"meta": meta, "config": config, "data": data_info,
                                    "attention_check": check, "runs": runs,
                                    "verdict": verdict}, indent=1))
        log(f"wrote {path}")
        plot(runs, path.with_suffix(".png"), log)
    return verdict


def smooth(xs, alpha=0.05):
    out, m = [], 0.0
    for i, x in enumerate(xs):
        m = alpha * x + (1 - alpha) * m
        out.append(m / (1 - (1 - alpha) ** (i + 1)))  # (bias-corrected EMA)
    return out


def plot(runs, path, log=print):
    """Per phase (columns): the whole run, then its last 40% zoomed in (rows). Lines: the train
    loss (bias-corrected EMA, alpha 0.05); circles: the validation points."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    # One colour a run: sage red, the SDPA seeds the rest of the tab10 cycle (any number of them).
    cycle = [c for c in plt.rcParams["axes.prop_cycle"].by_key()["color"] if c != "#d62728"]
    sdpa_seeds = sorted({r["seed"] for r in runs if r["attention"] == "sdpa"})
    colors = {("sdpa", s): cycle[i % len(cycle)] for i, s in enumerate(sdpa_seeds)}
    colors.update({("sage", r["seed"]): "#d62728" for r in runs if r["attention"] == "sage"})
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), gridspec_kw={"height_ratios": (1, 1.2)})
    for col, phase in enumerate(("pretrain", "finetune")):
        full, zoom = axes[0][col], axes[1][col]
        ys_zoom = []
        for r in (r for r in runs if r["phase"] == phase):
            c = colors[(r["attention"], r["seed"])]
            label = f"{r['attention']} seed {r['seed']}"
            ys = smooth(r["train_loss"])
            cut = len(ys) * 6 // 10
            late = [(s, v) for s, v in r["val"] if s >= cut]
            for ax, first, val in ((full, 0, r["val"]), (zoom, cut, late)):
                ax.plot(range(first, len(ys)), ys[first:], color=c, lw=1,
                        label=f"{label} train (EMA)")
                if val:
                    ax.plot(*zip(*val), "o", color=c, ms=4, mfc="none", label=f"{label} val")
            ys_zoom += ys[cut:] + [v for _, v in late]
        finite = [y for y in ys_zoom if math.isfinite(y)]
        if finite:
            pad = 0.08 * (max(finite) - min(finite)) + 1e-3
            zoom.set_ylim(min(finite) - pad, max(finite) + pad)
        full.set_title("pretraining from scratch" if phase == "pretrain"
                       else "fine-tuning from the SDPA seed-0 checkpoint")
        zoom.set_title("last 40% of the steps", fontsize=9)
        for ax in (full, zoom):
            ax.set_xlabel("step")
            ax.set_ylabel("loss (nats / byte)")
            ax.grid(alpha=0.3)
        full.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
