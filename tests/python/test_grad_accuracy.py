"""python -m sage_attn.grad_accuracy on the CPU: the input generators have the structure they
claim, the chunked float64 backward equals torch autograd in float64, the 16-bit-path detection
reads each signal, and main() runs end to end and writes strict JSON. Skips without torch."""
import json
import math
import warnings

import pytest

torch = pytest.importorskip("torch")

import sage_attn  # noqa: E402
from sage_attn import grad_accuracy as ga  # noqa: E402


def scores(q, k):
    g = q.shape[1] // k.shape[1]
    return q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5


def test_shapes_dtype_gqa_and_seed():
    q, k, v, d_o = ga.normal(2, 4, 32, 16, heads_kv=2, dtype="bf16", seed=7)
    assert q.shape == d_o.shape == (2, 4, 32, 16)
    assert k.shape == v.shape == (2, 2, 32, 16)
    assert all(x.dtype == torch.bfloat16 for x in (q, k, v, d_o))
    again = ga.normal(2, 4, 32, 16, heads_kv=2, dtype=torch.bfloat16, seed=7)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v, d_o), again))
    other = ga.normal(2, 4, 32, 16, heads_kv=2, dtype="bf16", seed=8)
    assert not torch.equal(q, other[0])
    for fn in ga.CLASSES.values():  # MQA too
        q, k, v, d_o = fn(1, 4, 64, 16, heads_kv=1, seed=1)
        assert k.shape == v.shape == (1, 1, 64, 16) and q.dtype == torch.float32
    with pytest.raises(ValueError):
        ga.normal(1, 4, 8, 16, heads_kv=3)


@pytest.mark.parametrize("m", [4.0, 10.0, 16.0])
def test_outlier_scale(m):
    q, k, _, _ = ga.outlier_scale(1, 2, 512, 64, m=m, seed=5)
    idx, _ = ga.outlier_channels(64, 4, 5)
    rest = [c for c in range(64) if c not in idx.tolist()]
    for x in (q, k):
        ratio = x[..., idx].std() / x[..., rest].std()
        assert ratio == pytest.approx(m, rel=0.1)


def test_outlier_bias():
    m = 8.0
    q, k, _, _ = ga.outlier_bias(1, 2, 512, 64, m=m, channels=6, seed=2)
    idx, signs = ga.outlier_channels(64, 6, 2)
    rest = [c for c in range(64) if c not in idx.tolist()]
    for x in (q, k):
        mean = x[..., idx].mean(dim=(0, 1, 2))
        assert torch.allclose(mean, m * signs, atol=0.3)
        assert x[..., rest].mean(dim=(0, 1, 2)).abs().max() < 0.3
        assert x[..., idx].std(dim=(0, 1, 2)).max() < 1.2  # an offset, not a scale


@pytest.mark.parametrize("keys", [1, 3])
def test_sink(keys):
    m = 8.0
    q, k, _, _ = ga.sink(1, 4, 512, 64, m=m, keys=keys, heads_kv=2, seed=3)
    others = k[:, :, keys:].norm(dim=-1).mean(dim=-1, keepdim=True)
    ratio = k[:, :, :keys].norm(dim=-1) / others
    assert torch.allclose(ratio, torch.full_like(ratio, m), rtol=1e-4)
    p = torch.softmax(scores(q, k), dim=-1)
    # attended: the sinks take a large share of every head's attention (uniform: keys / N)
    share = p[..., :keys].sum(dim=-1).mean(dim=-1)
    assert bool((share > 0.3).all()), share


@pytest.mark.parametrize("sd", [3.0, 10.0, 20.0])
def test_peaked(sd):
    q, k, _, _ = ga.peaked(1, 4, 256, 64, sd=sd, heads_kv=2, seed=4)
    assert float(scores(q, k).std()) == pytest.approx(sd, rel=0.2)


def test_outlier_sink_and_class_specs():
    q, k, _, _ = ga.outlier_sink(1, 2, 256, 64, m=10.0, sink_m=6.0, seed=9)
    idx, _ = ga.outlier_channels(64, 4, 9)
    rest = [c for c in range(64) if c not in idx.tolist()]
    assert q[..., idx].std() / q[..., rest].std() == pytest.approx(10.0, rel=0.15)
    ratio = k[:, :, 0].norm(dim=-1) / k[:, :, 1:].norm(dim=-1).mean(dim=-1)
    assert torch.allclose(ratio, torch.full_like(ratio, 6.0), rtol=1e-4)
    assert ga.parse_class("outlier_scale:16:8") == (ga.outlier_scale, {"m": 16.0, "channels": 8})
    assert ga.parse_class("sink:5:2") == (ga.sink, {"m": 5.0, "keys": 2})
    assert ga.parse_class("normal") == (ga.normal, {})
    for bad in ("nope", "normal:1", "outlier_scale:x", "sink:5:1.5"):
        with pytest.raises(ValueError):
            ga.parse_class(bad)


def autograd64(q, k, v, d_o, causal):
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = qq @ kk.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        j, i = torch.arange(nk)[None, :], torch.arange(nq)[:, None]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    o = torch.softmax(s, dim=-1) @ vv.repeat_interleave(g, 1)
    return (o.detach(), *torch.autograd.grad(o, (qq, kk, vv), d_o.double()))


@pytest.mark.parametrize("nq,nk,causal", [(37, 37, True), (29, 45, True), (37, 37, False)])
def test_chunked_float64_backward_matches_autograd(nq, nk, causal):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn((2, 4, nq, 16), generator=gen, dtype=torch.float64)
    k = torch.randn((2, 2, nk, 16), generator=gen, dtype=torch.float64) * 2
    v = torch.randn((2, 2, nk, 16), generator=gen, dtype=torch.float64)
    d_o = torch.randn((2, 4, nq, 16), generator=gen, dtype=torch.float64)
    want = autograd64(q, k, v, d_o, causal)
    for rows in (8, None):  # chunks that split the rows unevenly, and one chunk
        got = ga.attention_grad64(q, k, v, d_o, causal, rows=rows)
        for name, x, y in zip(("o", "dq", "dk", "dv"), got, want):
            assert (x - y).abs().max() < 1e-10, name


def test_grad_metrics():
    t = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    assert ga.grad_metrics(t.half(), t) == {"cos": pytest.approx(1.0), "rel_l1": 0.0}
    m = ga.grad_metrics(t + torch.tensor([0.6, 0.0, 0.0], dtype=torch.float64), t)
    assert m["rel_l1"] == pytest.approx(0.1)
    assert math.isnan(ga.grad_metrics(torch.tensor([float("nan"), 0, 0]), t)["cos"])


def test_backward_path_reads_the_fallback_counter(monkeypatch):
    count = [0]

    def step():  # a recompute: the counter grows and the package warns
        count[0] += 1
        warnings.warn("recomputed", sage_attn.SageBwdFallbackWarning)

    monkeypatch.setattr(sage_attn, "backward_fallbacks", lambda: count[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recompute's own warning is not passed on
        assert ga.backward_path(step) == "16-bit"
    assert ga.backward_path(lambda: None) == "8-bit"
    with pytest.warns(UserWarning, match="unrelated"):  # other warnings pass through
        assert ga.backward_path(lambda: warnings.warn("unrelated")) == "8-bit"


def test_main_end_to_end_on_cpu(tmp_path, capsys):
    argv = ["--device", "cpu", "--seqs", "64", "--dims", "64", "--heads", "2", "--gqa", "1,2",
            "--classes", "normal,outlier_scale:10", "--dtypes", "fp16", "--out", str(tmp_path)]
    assert ga.main(argv) == 0
    (path,) = tmp_path.glob("*-cpu-grad-accuracy.json")

    def no_constants(name):
        raise ValueError(f"{name} in the JSON")

    doc = json.loads(path.read_text(), parse_constant=no_constants)
    assert doc["device"] == "cpu" and doc["argv"] == argv and doc["torch"] == torch.__version__
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2  # classes x masks x GQA ratios
    assert all(list(r) == list(ga.ROW_FIELDS) for r in rows)
    assert {(r["class"], r["mask"], r["heads_kv"]) for r in rows} == {
        (c, m, h) for c in ("normal", "outlier_scale:10") for m in ("none", "causal")
        for h in (2, 1)}
    for r in rows:
        assert r["path"] in ("8-bit", "16-bit", "8-bit NaN")
        assert r["sage_error"] is None and r["sdpa_error"] is None
        for g in ga.GRADS:
            assert r[f"sdpa_{g}_cos"] > 0.9999 and r[f"sdpa_{g}_rel_l1"] < 0.01
            if r["path"] != "8-bit NaN":
                assert r[f"sage_{g}_cos"] > 0.99
        if r["class"] == "normal":
            assert r["path"] == "8-bit"
    out = capsys.readouterr().out
    assert "| class | D | dtype | mask | N | Hq:Hkv | path | dQ cos |" in out
    assert out.count("| normal | 64 | fp16 |") == 4
