"""SageAttn-mix (paper 001, §3.6): calibrate which attention call sites of a model need the
accurate kernel, save the plan, and run the model with it.

    from sage_attn import mix
    plan = mix.calibrate(model, sample_inputs, xi=0.1)     # measures every SDPA call site
    plan.save("mix.json")
    ...
    plan = mix.Plan.load("mix.json")
    with mix.apply(plan, model):                           # routes each call per the plan
        out = model(x)

**The two paths** depend on the GPU (`default_paths`): where the 4-bit kernel is the fast one
(sm_89, sm_120) the fast path is SageAttn2-4b (`"sage4"`: INT4 Q·Kᵀ, the kernel of the paper's
§3.6) and the accurate one SageAttn2-8b (`"sage8"`); on Hopper (sm_90, no fast 4-bit path) and
other GPUs, `"sage8"` (the SDPA drop-in, with its routing) against torch's SDPA (`"sdpa"`); on
the CPU, sage's CPU reference (`"sage8"`) against torch's SDPA, so that the whole flow runs in
CI. `calibrate(fast=..., accurate=...)` picks any two of "sage4", "sage8", "sage3" (FP4,
sageattn3) and "sdpa". Calls sage cannot take (attn_mask, dropout, unsupported head dims) run
torch's SDPA on either path.

**Call sites.** With an nn.Module (the model, or `modules=` for a pipeline, e.g.
`modules=pipe.transformer`), a site is the qualified name of the innermost submodule running
when SDPA is called, and the index of the call within that submodule's forward (usually 0):
"model.layers.3.self_attn#0". Names survive a reload of the model, a different batch or sequence
length, and code paths that skip layers; forward hooks find them (during calibration on every
submodule, under apply only on the planned ones). SDPA calls outside that module (a pipeline's
text encoder) are not sites: they run whatever SDPA was before. Without a module, a site is the
index of the call within a pass ("#7"): stable for a fixed architecture; a pass is one
calibration input, and under apply the `with` block, each `step()`/`set_step()` beginning a new
one. **Steps** (diffusion timesteps) are the user's key: `with mix.step(t):` around a step, or
`mix.set_step(i)` from a callback (a diffusers pipeline: `callback_on_step_end=
mix.diffusers_step`, the first step keyless, the others their index); the site is then
"name#i@t". A site never seen in calibration runs the fast path (apply's counts call it
"unplanned").

**Measurement.** Each calibration call runs the fast and the accurate path on the same inputs
and compares both with full precision (torch's SDPA in float64 on the CPU, float32 on CUDA);
the model then continues with the full-precision output, so every site is measured on the
trajectory of the exact model, not on errors of earlier sites. A call's accuracy is the paper's
cos·(1 − rel-L1) of the flattened output; a site's is the mean over its calls (all inputs;
`reduce="min"` for the worst call instead). The ⌈ξ·n⌉ sites of lowest accuracy go to the
accurate path (ties: the site seen first). Dropout is not applied while calibrating (call
model.eval()).

**Threads and compile.** Like `sage_attn.sdpa()`, calibrate and apply replace
F.scaled_dot_product_attention for the block (process-wide) and keep Python state per call: run
them eagerly, not inside torch.compile'd graphs.

Measured (CPU, tests/python/test_mix.py, a random-init 8-layer Llama-style transformers model
whose layers 2 and 5 have peaked attention and a K outlier channel): with 4-bit fast and 8-bit
accurate the plan (ξ = 0.25) chose exactly layers 2 and 5 and recovered 92-98 % of the logits
error; with 8-bit against torch's SDPA it chose layers 0 and 2 (the two worst measured) and
recovered 45-52 %. Details in docs/mix.md.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import json
import math
import warnings

import torch
import torch.nn.functional as F

from . import _lib
from . import _sdpa
from . import _torch as _t

FORMAT = "sage_attn.mix/1"
METRIC = "cos*(1-rel_l1)"
_OUTSIDE = "(outside)"  # the "module" of SDPA calls made outside every hooked module's forward
_ROOT = "(root)"        # the root module's own name ("" in named_modules)


# ---- the paths ----

def _torch_path(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    return _t._torch_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _sage_path(variant):
    def run(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
        if variant == "sage8" and q.is_cuda:
            # The SDPA drop-in: its routing (crossover model, unsupported calls) applies.
            return _t.scaled_dot_product_attention(q, k, v, **args)
        if _t._sdpa_unsupported(q, k, v, attn_mask, dropout_p, scale, enable_gqa,
                                cpu=True) is not None:
            return _torch_path(q, k, v, **args)
        q, k, v = _t._dropin_args(q, k, v)
        # SDPA's causal mask is top-left aligned.
        kw = dict(is_causal=is_causal, sm_scale=scale, causal_align="top_left")
        try:
            if variant == "sage3":
                return _t.sageattn3(q, k, v, **kw)
            return _t.sageattn(q, k, v, qk_bits=4 if variant == "sage4" else 8, **kw)
        except (_lib.SageUnsupportedError, NotImplementedError) as e:
            _t._warn_once(f"mix: no {variant} kernel for this call ({e})")
            return _torch_path(q, k, v, **args)
    run.__name__ = variant
    return run


# Path name -> the function computing it (SDPA's signature). Tests wrap these to count calls.
_PATHS = {"sage4": _sage_path("sage4"), "sage8": _sage_path("sage8"),
          "sage3": _sage_path("sage3"), "sdpa": _torch_path}


def default_paths(device=None) -> tuple[str, str]:
    """(fast, accurate) path names for a device (default: the current CUDA device, else CPU):
    ("sage4", "sage8") on sm_89 and sm_12x, where 4-bit is the fast kernel; ("sage8", "sdpa")
    on Hopper and other GPUs and on the CPU (sage's CPU reference against torch's SDPA)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return "sage8", "sdpa"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) == (8, 9) or major == 12:
        return "sage4", "sage8"
    return "sage8", "sdpa"


def _device_meta(device):
    device = torch.device(device)
    if device.type != "cuda":
        return {"device": device.type, "capability": None}
    major, minor = torch.cuda.get_device_capability(device)
    return {"device": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}"}


# ---- call sites ----

class _State:
    step = None      # the user's step key (str) or None
    tracker = None   # the _Tracker of the calibrate/apply block running


_state = _State()


def _step_key(key):
    if key is None:
        return None
    if isinstance(key, torch.Tensor) and key.numel() == 1:
        key = key.item()  # a diffusers timestep tensor
    if isinstance(key, float) and key.is_integer():
        key = int(key)  # 999.0 and 999 are one step
    if isinstance(key, bool) or not isinstance(key, (int, float, str)):
        raise TypeError(f"step = {key!r}: must be an int, a float, a str, a one-element tensor "
                        "or None")
    key = str(key)
    if "@" in key:
        raise ValueError(f"step = {key!r}: must not contain '@' (it separates a site's step)")
    return key


def set_step(key) -> None:
    """Sets the step key (a timestep, a step index) of the SDPA calls that follow, until the
    next set_step or the end of the calibrate/apply pass; None: no step."""
    _state.step = _step_key(key)
    if _state.tracker is not None:
        _state.tracker.counts.pop(_OUTSIDE, None)


@contextlib.contextmanager
def step(key):
    """`with mix.step(t): model(x)`: the SDPA calls of the block are sites of step t."""
    saved = _state.step
    set_step(key)
    try:
        yield
    finally:
        _state.step = saved


def diffusers_step(pipe, i, t, callback_kwargs):
    """A diffusers `callback_on_step_end` (`pipe(..., callback_on_step_end=mix.diffusers_step)`)
    keying the pipeline's steps: step i + 1 begins when step i ends, and after the last
    (pipe.num_timesteps) the key goes back to None, which the first step of every call has.
    Returns callback_kwargs unchanged."""
    last = getattr(pipe, "num_timesteps", None)
    set_step(None if isinstance(last, int) and i + 1 >= last else i + 1)
    return callback_kwargs


def _site_module(site):
    name = site.split("#", 1)[0]
    return "" if name == _ROOT else name


class _Tracker:
    """Which site an SDPA call is: the names of the hooked modules running (innermost last),
    each one's SDPA calls within its current forward, and the step."""

    def __init__(self, root, names=None):
        self.root = root
        self.stack = []
        self.counts = {}
        self.handles = []
        if root is None:
            return
        for name, m in root.named_modules():
            if names is None or name in names:
                self.handles.append(m.register_forward_pre_hook(
                    functools.partial(self._enter, name)))
                self.handles.append(m.register_forward_hook(
                    functools.partial(self._exit, name), always_call=True))

    def _enter(self, name, module, args):
        self.stack.append(name)
        self.counts[name] = 0

    def _exit(self, name, module, args, output):
        if self.stack and self.stack[-1] == name:
            self.stack.pop()

    def begin_pass(self):
        self.stack.clear()
        self.counts.clear()

    def site(self):
        """This call's site, or None for a call outside the root module."""
        if self.stack:
            name = self.stack[-1] or _ROOT
            key = self.stack[-1]
        elif self.root is not None:
            return None
        else:
            name = key = _OUTSIDE
        i = self.counts.get(key, 0)
        self.counts[key] = i + 1
        site = f"{name}#{i}" if name != _OUTSIDE else f"#{i}"
        return site if _state.step is None else f"{site}@{_state.step}"

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []


@contextlib.contextmanager
def _tracking(root, names=None):
    if _state.tracker is not None:
        raise RuntimeError("sage_attn.mix: calibrate and apply blocks cannot be nested")
    tracker = _Tracker(root, names)
    _state.tracker, saved_step = tracker, _state.step
    try:
        yield tracker
    finally:
        tracker.close()
        _state.tracker, _state.step = None, saved_step


# ---- the plan ----

class Plan:
    """Which path each call site runs. routes: site -> "fast" or "accurate"; fast, accurate:
    the path names; sites: site -> its measurements ({"calls", "fast": {"cos", "rel_l1",
    "accuracy", "accuracy_min"}, "accurate": {...}}); meta: device, capability, versions, xi,
    reduce, metric."""

    def __init__(self, routes, fast, accurate, sites=None, meta=None):
        for name, p in (("fast", fast), ("accurate", accurate)):
            if p not in _PATHS:
                raise ValueError(f"{name} = {p!r}: must be one of {sorted(_PATHS)}")
        for site, role in routes.items():
            if role not in ("fast", "accurate"):
                raise ValueError(f"routes[{site!r}] = {role!r}: must be 'fast' or 'accurate'")
        self.routes = dict(routes)
        self.fast, self.accurate = fast, accurate
        self.sites = dict(sites or {})
        self.meta = dict(meta or {})

    @property
    def accurate_sites(self) -> list:
        return [s for s, r in self.routes.items() if r == "accurate"]

    def path(self, site) -> str:
        """The path name a site runs (the fast one for a site not in the plan)."""
        return self.accurate if self.routes.get(site) == "accurate" else self.fast

    def with_xi(self, xi, reduce=None) -> "Plan":
        """The plan that ξ (and reduce) would have chosen from the same measurements."""
        return _choose(self.sites, xi, reduce or self.meta.get("reduce", "mean"), self.fast,
                       self.accurate, self.meta)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "fast": self.fast, "accurate": self.accurate,
                "meta": self.meta, "routes": self.routes, "sites": self.sites}

    @classmethod
    def from_dict(cls, d) -> "Plan":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"plan: not a {FORMAT} plan (format = "
                             f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r})")
        for field in ("fast", "accurate", "routes"):
            if field not in d:
                raise ValueError(f"plan: missing field {field!r}")
        if not isinstance(d["routes"], dict):
            raise ValueError("plan: 'routes' must be an object of site -> 'fast'/'accurate'")
        return cls(d["routes"], d["fast"], d["accurate"], d.get("sites"), d.get("meta"))

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path) -> "Plan":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"path = {str(path)!r}: not JSON ({e})") from None
        return cls.from_dict(d)

    def __eq__(self, other):
        return isinstance(other, Plan) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return (f"Plan({len(self.accurate_sites)} of {len(self.routes)} sites on "
                f"{self.accurate!r}, the rest on {self.fast!r})")


def _check_xi(xi):
    if isinstance(xi, bool) or not isinstance(xi, (int, float)) or not 0.0 <= xi <= 1.0:
        raise ValueError(f"xi = {xi!r}: must be a fraction in [0, 1] (0.1 for 10 %)")
    return float(xi)


def _choose(sites, xi, reduce, fast, accurate, meta):
    xi = _check_xi(xi)
    if reduce not in ("mean", "min"):
        raise ValueError(f"reduce = {reduce!r}: must be 'mean' or 'min'")
    field = "accuracy" if reduce == "mean" else "accuracy_min"
    order = list(sites)
    # Lowest accuracy first; ties keep the order the sites were first seen (sorted is stable).
    worst = sorted(order, key=lambda s: sites[s]["fast"][field])
    # ⌈ξ·n⌉: at least ξ of the sites go accurate (the tolerance absorbs ξ·n's rounding).
    n = math.ceil(xi * len(order) - 1e-9) if order else 0
    chosen = set(worst[:n])
    routes = {s: ("accurate" if s in chosen else "fast") for s in order}
    return Plan(routes, fast, accurate, sites, dict(meta, xi=xi, reduce=reduce))


# ---- calibration ----

def _accuracy(o, ref):
    """(cos, rel_l1) of the flattened output o against ref, in float64. A non-finite output
    scores cos 0, rel-L1 inf: the worst."""
    o, ref = o.detach().to(torch.float64).flatten(), ref.detach().to(torch.float64).flatten()
    if not bool(torch.isfinite(o).all()):
        return 0.0, math.inf
    no, nr, l1r = o.norm().item(), ref.norm().item(), ref.abs().sum().item()
    cos = (o @ ref).item() / (no * nr) if no > 0 and nr > 0 else float(no == nr)
    l1 = (o - ref).abs().sum().item()
    rel = l1 / l1r if l1r > 0 else (0.0 if l1 == 0 else math.inf)
    return cos, rel


def _summary(stats):
    cos = [c for c, _ in stats]
    rel = [r for _, r in stats]
    acc = [c * (1.0 - r) for c, r in stats]
    return {"cos": sum(cos) / len(cos), "rel_l1": sum(rel) / len(rel),
            "accuracy": sum(acc) / len(acc), "accuracy_min": min(acc)}


def _call_model(model, x):
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def calibrate(model, inputs, *, xi=0.1, modules=None, fast=None, accurate=None,
              reduce="mean") -> Plan:
    """Runs model on each of inputs (a tuple: model(*x); a dict: model(**x); else model(x)),
    measuring every attention call site (F.scaled_dot_product_attention calls) on the fast and
    the accurate path against full precision, and returns the plan that sends the ⌈ξ·n⌉ sites
    of lowest accuracy (the paper's cos·(1 − rel-L1), `reduce` "mean" or "min" over a site's
    calls) to the accurate path.

    model: a callable (an nn.Module, or e.g. a diffusers pipeline or a function); modules: the
    nn.Module whose submodule names identify the sites (default: model when it is one; for a
    pipeline, e.g. pipe.transformer). xi: a fraction in [0, 1]. fast, accurate: path names
    (default: default_paths() of the device of the first call). Run under torch.no_grad() and
    model.eval(); the model computes with full-precision attention while calibrating."""
    xi = _check_xi(xi)
    if reduce not in ("mean", "min"):
        raise ValueError(f"reduce = {reduce!r}: must be 'mean' or 'min'")
    if not callable(model):
        raise TypeError(f"model: expected a callable, got {type(model).__name__}")
    if modules is None and isinstance(model, torch.nn.Module):
        modules = model
    if modules is not None and not isinstance(modules, torch.nn.Module):
        raise TypeError(f"modules: expected a torch.nn.Module, got {type(modules).__name__}")
    for name, p in (("fast", fast), ("accurate", accurate)):
        if p is not None and p not in _PATHS:
            raise ValueError(f"{name} = {p!r}: must be one of {sorted(_PATHS)}")
    if isinstance(inputs, (torch.Tensor, dict)):
        raise TypeError("inputs: expected an iterable of samples (e.g. a list of tensors), got a "
                        f"single {type(inputs).__name__}; wrap it in a list")
    samples = list(inputs)
    if not samples:
        raise ValueError("inputs: no samples to calibrate on")

    calls = collections.OrderedDict()  # site -> ([(cos, rel) fast], [(cos, rel) accurate])
    chosen = {"fast": fast, "accurate": accurate, "device": None}

    previous = F.scaled_dot_product_attention  # (what calls outside `modules` run)
    with _tracking(modules) as tracker:
        def measure(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
            site = tracker.site()
            if site is None:
                return previous(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            if chosen["device"] is None:
                chosen["device"] = query.device
                f, a = default_paths(query.device)
                chosen["fast"] = chosen["fast"] or f
                chosen["accurate"] = chosen["accurate"] or a
            args = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
            # Full precision: float64 on the CPU; on CUDA float32 (SDPA's memory-efficient
            # kernel takes it), three orders below the 8-bit kernels' error.
            wide = torch.float64 if query.device.type == "cpu" else torch.float32
            mask = attn_mask
            if mask is not None and mask.dtype.is_floating_point:
                mask = mask.to(wide)
            ref = _t._torch_sdpa(query.to(wide), key.to(wide), value.to(wide),
                                 **dict(args, attn_mask=mask))
            out = calls.setdefault(site, ([], []))
            for role, stats in (("fast", out[0]), ("accurate", out[1])):
                o = _PATHS[chosen[role]](query, key, value, **args)
                stats.append(_accuracy(o, ref))
            return ref.to(query.dtype)

        with _sdpa.swapped(measure), torch.no_grad():
            for x in samples:
                tracker.begin_pass()
                _state.step = None
                _call_model(model, x)

    if not calls:
        raise RuntimeError("calibrate: the model made no torch.nn.functional."
                           "scaled_dot_product_attention call inside `modules` (a model on "
                           "another attention implementation, e.g. attn_implementation='eager'?)")
    sites = {s: {"calls": len(f), "fast": _summary(f), "accurate": _summary(a)}
             for s, (f, a) in calls.items()}
    meta = dict(_device_meta(chosen["device"]), sage_attn=_version(), libsage=_lib.version(),
                torch=torch.__version__, metric=METRIC, samples=len(samples),
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return _choose(sites, xi, reduce, chosen["fast"], chosen["accurate"], meta)


def _version():
    from . import __version__
    return __version__


# ---- applying a plan ----

class Routing:
    """What apply's block ran: counts[role] calls ("fast", "accurate", "unplanned": a site not
    in the plan, run on the fast path) and seen[site] = role."""

    def __init__(self):
        self.counts = collections.Counter()
        self.seen = {}


@contextlib.contextmanager
def apply(plan, model=None):
    """`with mix.apply(plan, model): model(x)`: each F.scaled_dot_product_attention call runs the
    path the plan gives its site. model: the nn.Module the plan's site names refer to (the one
    calibrate used: the model or its `modules`); needed unless the plan was made without one.
    Yields a Routing (the counts of the block's calls)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a sage_attn.mix.Plan, got {type(plan).__name__}")
    names = {_site_module(s) for s in plan.routes if not s.startswith("#")}
    if names and model is None:
        raise ValueError("model: this plan's sites are module names "
                         f"(e.g. {next(iter(plan.routes))!r}); pass the module calibrate used")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if model is not None:
        have = {n for n, _ in model.named_modules()}
        missing = sorted(names - have)
        if missing:
            raise ValueError(f"model: has no submodule {missing[0]!r} of the plan "
                             f"({len(missing)} missing; a plan made for another model?)")
    if model is not None and not names and plan.routes:
        model = None  # a plan of call indices: the module plays no part
    routing = Routing()
    warned = []

    previous = F.scaled_dot_product_attention
    with _tracking(model, names) as tracker:
        def route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
            args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
            site = tracker.site()
            if site is None:
                return previous(query, key, value, **args)
            if not warned:
                warned.append(True)
                here = _device_meta(query.device)
                if here["capability"] != plan.meta.get("capability", here["capability"]):
                    warnings.warn(f"sage_attn.mix: this plan was calibrated on "
                                  f"{plan.meta.get('device')} (sm {plan.meta.get('capability')}), "
                                  f"this call runs on {here['device']} (sm {here['capability']}); "
                                  "its paths are applied as saved", stacklevel=3)
            role = plan.routes.get(site, "unplanned")
            routing.counts[role] += 1
            routing.seen[site] = role
            return _PATHS[plan.path(site)](query, key, value, **args)

        with _sdpa.swapped(route):
            tracker.begin_pass()
            yield routing
