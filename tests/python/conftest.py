"""pytest setup: import sage_attn from the source tree when it is not installed, and a float64
attention written with plain numpy loops over heads (independent of the library)."""
import importlib.util
import os
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# sage_attn's C++ fast path, where scripts/test built it (python -m sage_attn.fastpath): the
# suite runs with it, except in the modules below.
os.environ.setdefault("SAGE_FASTPATH_DIR", str(ROOT / "build" / "fastpath"))
try:
    import sage_attn  # noqa: F401  (installed by pip)
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))


def load_tool(name):
    """tools/<name>.py as a module (the repository's tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def naive_attention(q, k, v, layout="HND", causal=None, scale=None, max_weight=False):
    """float64 attention; causal None / 'bottom_right' / 'top_left'. Returns (o, lse) with o in
    HND-or-NHD like q and lse [B, Hq, Nq] (natural log); with max_weight also each row's largest
    softmax weight [B, Hq, Nq] (0 for an empty row), last."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if layout == "NHD":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    o = np.zeros((B, Hq, Nq, D))
    lse = np.full((B, Hq, Nq), -np.inf)
    w = np.zeros((B, Hq, Nq))
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    if causal == "bottom_right":
        allowed = j <= i + (Nk - Nq)
    elif causal == "top_left":
        allowed = j <= i
    else:
        allowed = np.ones((Nq, Nk), dtype=bool)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            s = q[b, h] @ k[b, g].T * scale
            s = np.where(allowed, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            live = np.isfinite(m[:, 0])
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            o[b, h] = np.where(live[:, None], (p / np.where(l > 0, l, 1)) @ v[b, g], 0.0)
            lse[b, h] = np.where(live, np.log(np.where(l[:, 0] > 0, l[:, 0], 1)) + m[:, 0], -np.inf)
            w[b, h] = np.where(live, 1 / np.where(l[:, 0] > 0, l[:, 0], 1), 0.0)
    if layout == "NHD":
        o = o.transpose(0, 2, 1, 3)
    return (o, lse, w) if max_weight else (o, lse)


def count_calls(monkeypatch, owner, name):
    """Wraps owner.name (for the test) so that each call appends its positional arguments to
    the returned list, then runs the real one."""
    calls, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.fixture
def rng(request):
    # Fresh inputs on every run; the seed is printed on failure so a run can be repeated.
    seed = int(os.environ.get("SAGE_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))
    print(f"SAGE_TEST_SEED={seed}")
    # Also kept with the test's report (junit XML properties, the summary below): a log that
    # keeps only the summary (-q --tb=no, a CI's failure list) still has it.
    request.node.user_properties.append(("SAGE_TEST_SEED", seed))
    return np.random.default_rng(seed)


def pytest_terminal_summary(terminalreporter):
    # One line per failed test that drew a seed: how to repeat it.
    for rep in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", []):
        seeds = [v for k, v in getattr(rep, "user_properties", ()) if k == "SAGE_TEST_SEED"]
        if seeds:
            terminalreporter.write_line(f"SAGE_TEST_SEED={seeds[-1]} {rep.nodeid}")


@pytest.fixture(autouse=True)
def _fresh_backward_retry():
    # set_backward_retry's memory of refused kinds of call is per process: each test starts
    # without another's refusals.
    try:
        from sage_attn import _torch
    except ImportError:
        yield
        return
    _torch._skips.clear()
    yield
    _torch._skips.clear()


# Modules whose tests replace the drop-in's Python internals (stand-ins for the library, counted
# checks and plans): they test the Python path, which the fast path would skip on repeated calls.
_PYTHON_PATH_MODULES = {"test_dropin_cache", "test_torch_api", "test_backward"}


@pytest.fixture(autouse=True)
def _python_path_only(request, monkeypatch):
    if request.module.__name__.rsplit(".", 1)[-1] in _PYTHON_PATH_MODULES:
        try:
            from sage_attn import _torch
        except ImportError:  # (no torch: nothing to turn off)
            return
        monkeypatch.setattr(_torch, "_fast", None)
