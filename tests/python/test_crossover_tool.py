"""tools/crossover.py: the committed crossover model (src/api/crossover_model.inc) and the CPU
test's measured points (tests/cpu/crossover_points.inc) are what `fit` makes of the committed
sweeps, so neither is edited by hand or left behind a new sweep; the fit's rule on hand-made
measurements."""
import json
import pathlib
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy")

from conftest import load_tool  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "crossover.py"
cx = load_tool("crossover")


def test_generated_files_match_the_committed_sweeps(tmp_path):
    sweeps = sorted(str(p) for p in (ROOT / "bench" / "results").glob("*-crossover*.json"))
    assert sweeps
    out = subprocess.run([sys.executable, str(SCRIPT), "fit", *sweeps, "--emit",
                          str(tmp_path / "model.inc"), "--emit-points", str(tmp_path / "p.inc")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "model.inc").read_text() == \
        (ROOT / "src" / "api" / "crossover_model.inc").read_text()
    assert (tmp_path / "p.inc").read_text() == \
        (ROOT / "tests" / "cpu" / "crossover_points.inc").read_text()


def test_fit_recovers_a_known_model_and_its_margin(tmp_path):
    # Times made from known coefficients (sage's pre-pass dearer, its matmuls cheaper): the fit
    # predicts them, and the margin keeps every point where sage is over 2 % slower with SDPA.
    rng = np.random.default_rng(0)
    cs, cc = [0.012, 3.0, 3.5, 0.3, 0.6, 0.1], [0.005, 0.6, 1.0, 0.7, 0.6]
    rows = []
    for h in (4, 8, 16, 32, 64, 128):
        for n in (512, 1024, 2048, 3000, 4096, 6144, 8192, 12288, 16384):
            for causal in (False, True):
                fs = cx.features("sage", h, h, n, n, 128, causal, 132)
                fc = cx.features("cudnn", h, h, n, n, 128, causal, 132)
                noise = 1 + 0.002 * rng.standard_normal(2)
                rows.append({"heads_q": h, "heads_kv": h, "seq_q": n, "seq_k": n, "head_dim": 128,
                             "causal": causal, "batch": 1,
                             "sage_ms": cx.predict(cs, fs) * noise[0],
                             "cudnn_ms": cx.predict(cc, fc) * noise[1]})
    doc = {"gpu": "test", "sms": 132, "cc": "90", "mem_bus_bits": 5120, "commit": "x",
           "date": "2026-01-01", "rows": rows}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    assert cx.main(["fit", str(tmp_path / "s.json"), "--emit", str(tmp_path / "m.inc"),
                    "--emit-points", str(tmp_path / "p.inc")]) == 0
    lines = [x for x in (tmp_path / "m.inc").read_text().splitlines() if x.startswith("{")]
    assert len(lines) == 2  # one row per mask
    for line in lines:  # the fitted models predict the true times within the noise
        nums = [float(x) for x in line.replace("{", " ").replace("}", " ").replace(
            "true", "1").replace("false", "0").split(",") if x.strip()]
        causal, fs_, fc_ = bool(nums[4]), nums[5:11], nums[11:16]
        for r in rows:
            if r["causal"] == causal:
                args = (r["heads_q"], r["heads_kv"], r["seq_q"], r["seq_k"], 128, causal, 132)
                truth_s = cx.predict(cs, cx.features("sage", *args))
                truth_c = cx.predict(cc, cx.features("cudnn", *args))
                assert cx.predict(fs_, cx.features("sage", *args)) == pytest.approx(truth_s,
                                                                                    rel=0.02)
                assert cx.predict(fc_, cx.features("cudnn", *args)) == pytest.approx(truth_c,
                                                                                     rel=0.02)
    for line in (tmp_path / "p.inc").read_text().splitlines():
        if line.startswith("{"):
            f = [x.strip() for x in line.strip("{},").split(",")]
            sage_ms, cudnn_ms, chosen = float(f[11]), float(f[12]), f[14] == "true"
            if chosen:
                assert cudnn_ms / sage_ms >= 0.98
