"""The ctypes layer through the numpy front end (CPU reference): runs in CI without torch or GPU."""
import numpy as np
import pytest

import sage_attn
from conftest import naive_attention


def rand(rng, shape, dtype=np.float16, bias=0.0):
    x = rng.standard_normal(shape)
    if bias:
        x = x + bias * rng.standard_normal((1, 1, 1, shape[-1]))
    return x.astype(dtype)


def test_version_matches_package():
    assert sage_attn.version() == sage_attn.__version__


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
@pytest.mark.parametrize("nq,nk,hq,hkv", [(37, 53, 4, 2), (64, 19, 2, 1), (1, 130, 2, 2)])
def test_exact_matches_naive(rng, layout, causal, nq, nk, hq, hkv):
    d = 32
    shp = lambda h, n: (2, h, n, d) if layout == "HND" else (2, n, h, d)  # noqa: E731
    q, k, v = rand(rng, shp(hq, nq), np.float32), rand(rng, shp(hkv, nk), np.float32), \
        rand(rng, shp(hkv, nk), np.float32)
    o, lse = sage_attn.attention_numpy(q, k, v, tensor_layout=layout, is_causal=causal is not None,
                                       causal_align=causal or "bottom_right", return_lse=True,
                                       exact=True, sm_scale=0.3)
    ref, ref_lse = naive_attention(q, k, v, layout, causal, 0.3)
    assert o.dtype == np.float32 and o.shape == q.shape
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
    live = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-5, atol=1e-5)


def test_strided_views_equal_contiguous(rng):
    big = rand(rng, (2, 6, 90, 64))
    q, k, v = big[:, 0:4, :70], big[:, 4:5, ::2], big[:, 5:6, 1::2]  # GQA 4:1, strided tokens
    o = sage_attn.attention_numpy(q, k, v)
    o2 = sage_attn.attention_numpy(*(np.ascontiguousarray(x) for x in (q, k, v)))
    np.testing.assert_array_equal(o, o2)
    nhd = sage_attn.attention_numpy(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)),
                                    tensor_layout="NHD")
    np.testing.assert_array_equal(nhd.transpose(0, 2, 1, 3), o)


def test_quantized_close_to_float64_and_deterministic(rng):
    q, k, v = rand(rng, (1, 2, 300, 128)), rand(rng, (1, 2, 300, 128)), rand(rng, (1, 2, 300, 128))
    ref, _ = naive_attention(q, k, v)
    o8 = sage_attn.attention_numpy(q, k, v)
    m8 = sage_attn.metrics(o8, ref)
    assert m8["cos"] > 0.999 and m8["rel_l1"] < 0.06, m8
    m4 = sage_attn.metrics(sage_attn.attention_numpy(q, k, v, qk_bits=4), ref)
    assert m4["rel_l1"] > m8["rel_l1"], (m4, m8)  # INT4 loses more than INT8
    np.testing.assert_array_equal(o8, sage_attn.attention_numpy(q, k, v))


def test_smoothing_flags_reach_the_library(rng):
    # A large channel bias in K: INT4 without smoothing K is far worse than with it.
    q = rand(rng, (1, 2, 256, 64), bias=2.0)
    k = rand(rng, (1, 2, 256, 64), bias=10.0)
    v = rand(rng, (1, 2, 256, 64), bias=4.0)
    ref, _ = naive_attention(q, k, v)
    err = lambda **kw: sage_attn.metrics(  # noqa: E731
        sage_attn.attention_numpy(q, k, v, qk_bits=4, **kw), ref)["rel_l1"]
    assert err(smooth_k=True, smooth_q=True) < err(smooth_k=False, smooth_q=True)
    assert err(smooth_v=True) < err(smooth_v=False)


def test_inputs_untouched(rng):
    q, k, v = rand(rng, (1, 2, 50, 64)), rand(rng, (1, 1, 40, 64)), rand(rng, (1, 1, 40, 64))
    saved = [x.copy() for x in (q, k, v)]
    sage_attn.attention_numpy(q, k, v, is_causal=True, return_lse=True)
    for x, s in zip((q, k, v), saved):
        np.testing.assert_array_equal(x, s)


@pytest.mark.parametrize("call,exc,words", [
    (lambda q, k, v: sage_attn.attention_numpy(q.astype(np.float64), k, v), TypeError, "float64"),
    (lambda q, k, v: sage_attn.attention_numpy(q[0], k, v), ValueError, "q"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, tensor_layout="BNHD"), ValueError,
     "tensor_layout"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, qk_bits=6), ValueError, "qk_bits"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, sm_scale=-1.0), ValueError, "sm_scale"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, smooth_k="yes"), TypeError, "smooth_k"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, causal_align="left"), ValueError,
     "causal_align"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, bogus=1), TypeError, "bogus"),
    # is_causal and return_lse are bools, as in sageattn: 1, "yes" or an array are mistakes.
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, is_causal=1), TypeError, "is_causal"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, is_causal="top_left"), TypeError,
     "is_causal"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, is_causal=np.ones((20, 20), bool)),
     TypeError, "is_causal"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, return_lse=1), TypeError, "return_lse"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k[:, :, :, :32], v[:, :, :, :32]), ValueError,
     "head_dim"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v[:, :, :5]), ValueError, "v"),
    (lambda q, k, v: sage_attn.attention_numpy(q[:, :3], k, v), ValueError, "heads"),
    # exact is float64 attention: a quantization keyword with it is refused, not dropped.
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, exact=True, qk_bits=4), ValueError,
     "qk_bits cannot be given"),
    (lambda q, k, v: sage_attn.attention_numpy(q, k, v, exact=True, smooth_k=False), ValueError,
     "smooth_k cannot be given"),
])
def test_bad_arguments_raise_naming_the_argument(rng, call, exc, words):
    q, k, v = rand(rng, (1, 4, 20, 64)), rand(rng, (1, 2, 20, 64)), rand(rng, (1, 2, 20, 64))
    with pytest.raises(exc, match=words):
        call(q, k, v)


def test_library_errors_are_value_errors(rng):
    # Validation inside the C library (not the Python front end) comes back as ValueError.
    q, k, v = rand(rng, (1, 3, 20, 64)), rand(rng, (1, 2, 20, 64)), rand(rng, (1, 2, 20, 64))
    with pytest.raises(sage_attn.SageArgumentError, match="heads_kv") as info:
        sage_attn.attention_numpy(q, k, v)
    assert isinstance(info.value, ValueError)


def test_accuracy_tool_on_npy_files(rng, tmp_path, capsys):
    from sage_attn import accuracy
    q, k, v = rand(rng, (1, 2, 96, 64), np.float32), \
        rand(rng, (1, 2, 80, 64), np.float32, bias=3.0), rand(rng, (1, 2, 80, 64), np.float32)
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", x[0])  # [H, N, D] files
    assert accuracy.main(["--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--v",
                          str(tmp_path / "v.npy"), "--causal", "--cpu", "--json"]) == 0
    import json
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)}
    # The tool's float64 reference is the library's; check its 8b figure independently here.
    ref, _ = naive_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16),
                             "HND", "bottom_right")
    o8 = sage_attn.attention_numpy(*(x.astype(np.float16) for x in (q, k, v)), is_causal=True)
    want = sage_attn.metrics(o8, ref)
    got = rows["SageAttn2-8b (CPU emulation)"]
    assert abs(got["rel_l1"] - want["rel_l1"]) < 1e-4 * max(1.0, want["rel_l1"]) + 1e-3
    assert got["cos"] > 0.999
    assert rows["SageAttn2-8b, no smoothing (CPU emulation)"]["rel_l1"] > got["rel_l1"]
