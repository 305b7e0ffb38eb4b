"""The package's command lines and how they fail: `python -m sage_attn.accuracy` (one line and
exit status 2 for an input it cannot use, 1 for a non-finite output) and `python -m
sage_attn.bench --help` without torch. Runs without torch or GPU."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import sage_attn
from sage_attn import accuracy

# The directory sage_attn was imported from, for the subprocesses (conftest may have put the
# source tree on sys.path, which a child process does not inherit).
PACKAGE_ROOT = str(pathlib.Path(sage_attn.__file__).resolve().parents[1])


def python_m(*args, block_torch=False):
    """`python -m <args>` in a child process: (exit status, stdout, stderr). block_torch makes
    `import torch` fail there, as on a machine without it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [PACKAGE_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    code = ("import runpy, sys\n"
            + ("sys.modules['torch'] = None\n" if block_torch else "")
            + f"sys.argv = {['python -m ' + args[0], *args[1:]]!r}\n"
            + f"runpy.run_module({args[0]!r}, run_name='__main__', alter_sys=True)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def files(tmp_path):
    """A valid [H, N, D] float32 input, and a way to write others next to it."""
    rng = np.random.default_rng(0)
    ok = rng.standard_normal((2, 40, 64)).astype(np.float32)
    np.save(tmp_path / "ok.npy", ok)

    def save(name, x):
        np.save(tmp_path / name, x)
        return str(tmp_path / name)
    save.ok, save.dir = ok, tmp_path
    return save


def run_accuracy(q, files, capsys, v=None):
    ok = str(files.dir / "ok.npy")
    status = accuracy.main(["--q", q, "--k", ok, "--v", v or ok, "--cpu", "--json"])
    out, err = capsys.readouterr()
    return status, out, err


def corrupt(files):
    raw = (files.dir / "ok.npy").read_bytes()
    (files.dir / "short.npy").write_bytes(raw[:300])
    return str(files.dir / "short.npy")


def garbage(files):
    (files.dir / "garbage.npy").write_bytes(b"not an array at all" * 8)
    return str(files.dir / "garbage.npy")


def with_value(files, name, index, value):
    x = files.ok.copy()
    x[index] = value
    return files(name, x)


@pytest.mark.parametrize("make,words", [
    (lambda f: str(f.dir / "missing.npy"), "missing.npy: no such file"),
    (corrupt, "short.npy: cannot read it"),
    (garbage, "garbage.npy: not a .npy file"),
    (lambda f: f("int32.npy", f.ok.astype(np.int32)),
     "int32.npy: dtype int32 is not a floating-point type"),
    (lambda f: f("empty.npy", f.ok[:, :0]), "empty.npy: N = 0: the tensor is empty"),
    (lambda f: with_value(f, "q.npy", (1, 3, 7), -1.0e5),
     "q.npy: values up to 1e+05 overflow fp16 (max 65504)"),
    (lambda f: with_value(f, "nan.npy", (0, 0, 0), np.nan),
     "nan.npy: 1 of 5120 values are NaN or infinite"),
    (lambda f: f("wide.npy", np.ones((2, 40, 32), np.float32)), "head_dim"),  # q's D != k's
])
def test_accuracy_input_errors_are_one_line(files, capsys, make, words):
    status, out, err = run_accuracy(make(files), files, capsys)
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and words in err, err
    assert err.startswith("python -m sage_attn.accuracy: ")


def test_accuracy_error_from_the_command_line(files):
    # The same through `python -m`: no traceback, one line, status 2.
    ok = str(files.dir / "ok.npy")
    status, out, err = python_m("sage_attn.accuracy", "--q", str(files.dir / "nope.npy"), "--k",
                                ok, "--v", ok, "--cpu")
    assert status == 2 and out == ""
    assert err == f"python -m sage_attn.accuracy: {files.dir / 'nope.npy'}: no such file\n"


def test_accuracy_exits_nonzero_on_a_non_finite_output(files, capsys):
    # V at fp16's largest value: the fp16 output of the emulation without V smoothing rounds
    # past 65504 to infinity (with smoothing, V's mean is added back exactly). Finite, in-range
    # inputs; the table is still printed, then one line per offending configuration, status 1.
    rng = np.random.default_rng(1)
    q = files("q.npy", rng.standard_normal((1, 64, 64)).astype(np.float16))
    k = files("k.npy", rng.standard_normal((1, 64, 64)).astype(np.float16))
    v = files("v.npy", np.full((1, 64, 64), 65504, np.float16))
    status = accuracy.main(["--q", q, "--k", k, "--v", v, "--cpu"])
    out, err = capsys.readouterr()
    assert status == 1
    assert "SageAttn2-8b (CPU emulation)" in out
    lines = err.splitlines()
    assert lines and all("outputs are not finite" in line for line in lines), err
    assert any("no smooth V" in line for line in lines), err
    # The same inputs with smoothing only are fine: the check is on the output, not the input.
    o = sage_attn.attention_numpy(*(np.load(p)[None] for p in (q, k, v)), smooth_v=True)
    assert np.isfinite(o).all()


def test_accuracy_runs_clean_on_good_input(files, capsys):
    ok = str(files.dir / "ok.npy")
    status, out, err = run_accuracy(ok, files, capsys, v=ok)
    assert status == 0 and err == "", err
    assert "SageAttn2-8b (CPU emulation)" in out


def test_bench_help_without_torch():
    status, out, err = python_m("sage_attn.bench", "--help", block_torch=True)
    assert status == 0, err
    assert out.startswith("usage: python -m sage_attn.bench") and "--dims" in out, out
    # A run, not --help, says in one line that it needs torch.
    status, out, err = python_m("sage_attn.bench", "--dims", "64", block_torch=True)
    assert status == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "python -m sage_attn.bench needs PyTorch (import torch failed)"], err
    # --models runs the real-model table (sage_attn.bench_models), which says the same.
    status, out, err = python_m("sage_attn.bench", "--models", block_torch=True)
    assert status == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "python -m sage_attn.bench_models needs PyTorch (import torch failed)"], err


def test_bench_train_help_without_torch():
    status, out, err = python_m("sage_attn.bench_train", "--help", block_torch=True)
    assert status == 0, err
    assert "usage:" in out and "--seqs" in out, out
    status, out, err = python_m("sage_attn.bench_train", "--dims", "64", block_torch=True)
    assert status == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "python -m sage_attn.bench_train needs PyTorch (import torch failed)"], err
    status, out, err = python_m("sage_attn.bench_train", "--impls", "sage,cudnn", block_torch=True)
    assert status == 2 and "--impls: unknown cudnn" in err, err
