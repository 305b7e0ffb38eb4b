"""SageAttention3's FP4 attention from Python: `python -m sage_attn.accuracy` prints its paper's
Table 1 (CPU emulation) beside its SageAttention2 rows, and attention_numpy(quant=...) runs any
config, the FP4 ones included. Runs without torch or GPU."""
import json

import numpy as np
import pytest

import sage_attn
from sage_attn import _lib, accuracy
from conftest import naive_attention

FP4_LABELS = ["fp16 (P~, V in fp16, fp32 accumulator)", "SageAttn2-8b",
              "MXFP4 Q·K only (P~, V in fp16)", "NVFP4 Q·K only (P~, V in fp16)",
              "MXFP4 (E8M0 scale / 32), P~ direct", "NVFP4 (E4M3 scale / 16), P~ direct",
              "NVFP4, P~ two-level (SageAttn3)", "NVFP4, P~ two-level + smooth V"]


@pytest.fixture
def inputs(tmp_path, rng):
    """q, k, v .npy files [H, N, D] with a channel bias (lengths off every block size)."""
    paths = []
    for name, n in (("q", 150), ("k", 203), ("v", 203)):
        x = rng.standard_normal((2, n, 64)) + 2.0 * rng.standard_normal((2, 1, 64))
        np.save(tmp_path / f"{name}.npy", x.astype(np.float32))
        paths.append(str(tmp_path / f"{name}.npy"))
    return paths


def run_json(paths, capsys, *extra):
    q, k, v = paths
    status = accuracy.main(["--q", q, "--k", k, "--v", v, "--cpu", "--json", *extra])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


def test_accuracy_prints_table_1_on_users_tensors(inputs, capsys):
    rows = run_json(inputs, capsys)
    fp4 = [r for r in rows if r["table"] == accuracy.TABLE_FP4]
    assert [r["config"] for r in fp4] == FP4_LABELS
    assert all(r["table"] == accuracy.TABLE_SAGE for r in rows if r not in fp4)
    m = {r["config"]: r for r in fp4}
    for r in fp4:
        assert all(np.isfinite(r[key]) for key in ("cos", "rel_l1", "rmse", "max_abs")), r
    # Coarse but still attention; fp16 is far ahead of 8-bit, which is ahead of any FP4 row.
    assert m["fp16 (P~, V in fp16, fp32 accumulator)"]["rel_l1"] < m["SageAttn2-8b"]["rel_l1"]
    for label in FP4_LABELS[2:]:
        assert m["SageAttn2-8b"]["rel_l1"] < m[label]["rel_l1"], label
        assert m[label]["cos"] > 0.98, (label, m[label])
    # Each row is the CPU emulation of its config: the same numbers from attention_numpy.
    q, k, v = (np.load(p)[None].astype(np.float16) for p in inputs)
    ref = sage_attn.attention_numpy(*(x.astype(np.float32) for x in (q, k, v)), exact=True)
    for label, cfg in accuracy._fp4_configs():
        got = sage_attn.metrics(sage_attn.attention_numpy(q, k, v, quant=cfg), ref)
        assert got == pytest.approx({key: m[label][key] for key in got}, rel=1e-12), label


def test_accuracy_table_text_and_no_fp4(inputs, capsys):
    q, k, v = inputs
    assert accuracy.main(["--q", q, "--k", k, "--v", v, "--cpu", "--causal"]) == 0
    out = capsys.readouterr().out
    assert accuracy.TABLE_FP4 in out
    for label in FP4_LABELS:
        assert label in out
    rows = run_json(inputs, capsys, "--no-fp4")
    assert rows and all(r["table"] == accuracy.TABLE_SAGE for r in rows)


def test_numpy_quant_runs_the_sage3_preset(rng):
    q, k, v = (rng.standard_normal((1, 2, n, 64)).astype(np.float16) for n in (70, 90, 90))
    cfg = _lib.preset(_lib.VARIANT_SAGE3_FP4)
    assert (cfg.qk_format, cfg.pv_format) == (_lib.QK_NVFP4, _lib.PV_NVFP4)
    o = sage_attn.attention_numpy(q, k, v, is_causal=True, quant=cfg)
    want, _ = naive_attention(q, k, v, causal="bottom_right")
    # NVFP4's Q·Kᵀ and P·V at D = 64 on N(0,1) give cos about 0.98, with a tail below it that
    # depends on the seed; a broken FP4 path lands far lower.
    assert sage_attn.metrics(o, want)["cos"] > 0.97
    # Not the 8-bit kernel under another name.
    assert not np.array_equal(o, sage_attn.attention_numpy(q, k, v, is_causal=True))


@pytest.mark.parametrize("kw,error,words", [
    ({"quant": "nvfp4"}, TypeError, "quant: expected"),
    ({"quant": _lib.QuantConfig(), "qk_bits": 4}, ValueError, "qk_bits cannot be given"),
    ({"quant": None, "qk_bits": 4, "exact": False}, None, None),
])
def test_numpy_quant_errors_name_the_argument(kw, error, words):
    q = np.zeros((1, 1, 16, 64), np.float16)
    if error is None:
        sage_attn.attention_numpy(q, q, q, **kw)
        return
    with pytest.raises(error, match=words):
        sage_attn.attention_numpy(q, q, q, **kw)


def test_invalid_fp4_config_is_refused_by_the_library():
    q = np.zeros((1, 1, 16, 64), np.float16)
    cfg = _lib.preset(_lib.VARIANT_SAGE3_FP4)
    cfg.block_k = 40  # P~'s runs of 16 would straddle key blocks
    with pytest.raises(sage_attn.SageArgumentError, match="block_k"):
        sage_attn.attention_numpy(q, q, q, quant=cfg)
