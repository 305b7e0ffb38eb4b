"""tools/train_parity.py's smoke configuration on CPU tensors (sage runs the CPU reference's
forward and SageBwd emulation): the JSON's fields, finite losses that go down, the verdict's
rules on hand-made runs; the file runs as a script. Skips without torch."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import load_tool  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "train_parity.py"
tp = load_tool("train_parity")


def test_an_experiment_not_a_module_of_the_package():
    import sage_attn
    assert not (pathlib.Path(sage_attn.__file__).parent / "train_parity.py").exists()
    # Runnable as `python tools/train_parity.py` from a checkout, without PYTHONPATH (it finds
    # the checkout's python/ itself).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--smoke" in out.stdout and "--budget-s" in out.stdout


def test_smoke_on_cpu(tmp_path):
    verdict = tp.main(["--smoke", "--device", "cpu", "--steps", "5", "--ft-steps", "2",
                       "--batch", "2", "--val-seqs", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*-cpu-train-parity.json")
    doc = json.loads(path.read_text())
    assert doc["verdict"]["pass"] == verdict["pass"]
    assert doc["config"]["model"] == {"layers": 2, "d_model": 64, "heads": 2, "head_dim": 32,
                                      "context": 128, "parameters": doc["config"]["model"]
                                      ["parameters"]}
    slices = doc["data"]["slices"]
    assert set(slices) == {"pretrain_train", "pretrain_val", "finetune_train", "finetune_val"}
    assert all(s["tokens"] > 10000 and s["files"] > 0 for s in slices.values())
    for grads in ("o", "dq", "dk", "dv"):  # (the CPU emulation against torch's bf16 SDPA)
        assert doc["attention_check"][grads]["cos"] > 0.99
    runs = doc["runs"]
    assert [(r["phase"], r["attention"], r["seed"]) for r in runs] == [
        (phase, attn, seed) for phase in ("pretrain", "finetune")
        for attn, seed in (("sdpa", 0), ("sdpa", 1), ("sdpa", 2), ("sage", 0))]
    for r in runs:
        assert r["finite"] and len(r["train_loss"]) == r["steps"] == len(r["grad_norm"])
        assert [s for s, _ in r["val"]] == sorted({round(i * r["steps"] / 2) for i in range(3)})
        assert r["final_val_loss"] == r["val"][-1][1]
        assert r["final_train_loss"] == pytest.approx(r["train_loss"][-1], abs=1e-9)  # 10% of 5
        assert r["seconds"] > 0 and r["train_ms_per_step"] > 0
        # Backward calls: a step's layers; SDPA's never go to a 16-bit recompute.
        assert r["backward_calls"] == r["steps"] * 2
        assert len(r["backward_16bit_per_step"]) == r["steps"]
        assert sum(r["backward_16bit_per_step"]) == r["backward_16bit"] <= r["backward_calls"]
        if r["attention"] == "sdpa":
            assert r["backward_16bit"] == 0
        if r["phase"] == "pretrain":  # from about ln(256) = 5.55 down
            assert 4.8 < r["train_loss"][0] < 6.0
            assert r["train_loss"][-1] < r["train_loss"][0] - 0.1
            assert r["val"][-1][1] < r["val"][0][1] - 0.1
    # Same seed, same init and batches: sage's first loss is SDPA's up to the attention's error.
    assert runs[3]["train_loss"][0] == pytest.approx(runs[0]["train_loss"][0], abs=2e-3)
    assert runs[0]["train_loss"][0] != runs[1]["train_loss"][0]
    # Fine-tuning starts from the SDPA seed-0 checkpoint: the SDPA runs' step-0 validations agree.
    assert runs[4]["val"][0][1] == runs[5]["val"][0][1] == runs[6]["val"][0][1]
    for phase in ("pretrain", "finetune"):
        v = doc["verdict"][phase]
        for key in ("sdpa_finals", "sdpa_mean", "sdpa_std", "sage_seed0", "spread",
                    "prediction_half_width", "within_prediction", "within_spread",
                    "diff_in_spreads", "curve_gap", "curve_noise", "curves_overlap"):
            assert key in v
    if _has_matplotlib():
        assert path.with_suffix(".png").is_file()


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _run(phase, attn, seed, vals):
    return {"phase": phase, "attention": attn, "seed": seed, "finite": True,
            "val": [[i * 10, v] for i, v in enumerate(vals)], "final_val_loss": vals[-1]}


def test_plot_any_number_of_seeds(tmp_path):
    # Four SDPA seeds (the default) and one sage run per phase: one colour a run, a PNG written.
    pytest.importorskip("matplotlib")
    runs = []
    for phase in ("pretrain", "finetune"):
        for attn, seed in [("sdpa", s) for s in range(4)] + [("sage", 0)]:
            r = _run(phase, attn, seed, [5.5, 2.0 + 0.01 * seed, 1.5])
            r["train_loss"] = [5.5 - 0.1 * i + 0.01 * seed for i in range(30)]
            runs.append(r)
    lines = []
    tp.plot(runs, tmp_path / "p.png", log=lines.append)
    assert (tmp_path / "p.png").stat().st_size > 1000 and lines == [f"wrote {tmp_path / 'p.png'}"]


def test_verdict_rules():
    runs = [_run("pretrain", "sdpa", 0, [5.5, 2.0, 1.50]),
            _run("pretrain", "sdpa", 1, [5.5, 2.1, 1.52]),
            _run("pretrain", "sdpa", 2, [5.5, 2.04, 1.49]),
            _run("pretrain", "sage", 0, [5.5, 2.05, 1.51])]
    c = tp.compare(runs, "pretrain")
    mean = (1.50 + 1.52 + 1.49) / 3
    std = ((1.50 - mean) ** 2 + (1.52 - mean) ** 2 + (1.49 - mean) ** 2) ** 0.5 / 2 ** 0.5
    assert c["sdpa_mean"] == pytest.approx(mean) and c["sdpa_std"] == pytest.approx(std)
    # 95% prediction interval, two degrees of freedom: t = 4.303
    assert c["prediction_half_width"] == pytest.approx(4.303 * std * (4 / 3) ** 0.5)
    assert c["within_prediction"] and c["within_spread"]
    assert c["diff_in_spreads"] == pytest.approx((1.51 - mean) / 0.03)
    assert c["curve_noise"] == pytest.approx(0.1) and c["curve_gap"] == pytest.approx(0.05)
    assert c["curves_overlap"]
    # Outside the seeds' range but inside the interval: a pass the old rule failed.
    runs[3] = _run("pretrain", "sage", 0, [5.5, 2.05, 1.53])
    c = tp.compare(runs, "pretrain")
    assert not c["within_spread"] and c["within_prediction"]
    # Far outside: fails, and a curve that departs more than the seeds do does not overlap.
    runs[3] = _run("pretrain", "sage", 0, [5.5, 2.25, 1.60])
    c = tp.compare(runs, "pretrain")
    assert not c["within_prediction"] and not c["curves_overlap"]
    runs[3] = _run("pretrain", "sage", 0, [5.5, 2.05, 1.51])
    runs[3]["finite"] = False
    assert not tp.compare(runs, "pretrain")["within_prediction"]


def test_lr_schedule():
    assert tp.lr_at(0, 100, 1.0, 0.05) == pytest.approx(0.2)
    assert tp.lr_at(4, 100, 1.0, 0.05) == pytest.approx(1.0)
    assert tp.lr_at(5, 100, 1.0, 0.05) == pytest.approx(1.0)
    assert tp.lr_at(100, 100, 1.0, 0.05) == pytest.approx(0.1)


def test_fit_budget():
    a = tp.parse_args([])
    assert (a.steps, a.ft_steps, a.batch, a.context) == (600, 200, 16, 2048)
    assert a.sdpa_seeds == 4
    ms = {"sdpa": 30.0, "sage": 45.0}  # 165 ms a step of all five runs, 132 s for 800 steps
    steps, ft_steps, scale, est = tp.fit_budget(a, ms, 200.0)
    assert (steps, ft_steps, scale) == (600, 200, 1.0) and 132 < est < 142
    steps, ft_steps, scale, est = tp.fit_budget(a, ms, 80.0)
    assert scale < 0.55 and steps == int(600 * scale) and ft_steps == int(200 * scale)
    assert (steps + ft_steps) * 0.165 < 0.9 * 80
