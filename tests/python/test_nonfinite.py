"""Non-finite inputs through the Python faces (docs/c-api.md, "Non-finite inputs"): the rows an Inf/NaN
reaches are NaN, every other row equals the call on the inputs with the bad elements zeroed. The
numpy front end (CPU emulation) runs in CI; sageattn on CUDA tensors where a GPU is present."""
import numpy as np
import pytest

import sage_attn


def poisoned_inputs(rng, layout, nq, nk, hq, hkv, d, dtype=np.float16):
    shp = lambda h, n: (1, h, n, d) if layout == "HND" else (1, n, h, d)  # noqa: E731
    q, k, v = (rng.standard_normal(shp(h, n)).astype(dtype)
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    qz, kz, vz = q.copy(), k.copy(), v.copy()
    at = lambda h, n, c: (0, h, n, c) if layout == "HND" else (0, n, h, c)  # noqa: E731
    iq, jk, jv = int(rng.integers(nq)), int(rng.integers(nk)), int(rng.integers(nk))
    spots = [(q, qz, at(1, iq, 3), np.nan), (k, kz, at(0, jk, 5), -np.inf),
             (v, vz, at(1 % hkv, jv, 7), np.inf)]
    for x, z, pos, bad in spots:
        x[pos] = bad
        z[pos] = 0
    return (q, k, v), (qz, kz, vz), (iq, jk, jv)


def expected_rows(nq, nk, hq, hkv, causal, iq, jk, jv):
    """[Hq, Nq] bool: the rows marked NaN."""
    i = np.arange(nq)
    if causal == "bottom_right":
        n = np.clip(i + nk - nq + 1, 0, nk)
    elif causal == "top_left":
        n = np.clip(i + 1, 0, nk)
    else:
        n = np.full(nq, nk)
    rows = np.zeros((hq, nq), dtype=bool)
    for h in range(hq):
        g = h // (hq // hkv)
        if h == 1:
            rows[h, iq] = True
        if g == 0:
            rows[h] |= jk < n
        if g == 1 % hkv:
            rows[h] |= jv < n
    return rows & (n > 0)[None, :]


def as_hnd(x, layout):
    return x if layout == "HND" else x.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
@pytest.mark.parametrize("qk_bits", [8, 4])
def test_numpy_marks_reached_rows(rng, layout, causal, qk_bits):
    nq, nk, hq, hkv, d = 150, 210, 4, 2, 64
    bad, zeroed, (iq, jk, jv) = poisoned_inputs(rng, layout, nq, nk, hq, hkv, d)
    kw = dict(tensor_layout=layout, is_causal=causal is not None,
              causal_align=causal or "bottom_right", return_lse=True, qk_bits=qk_bits)
    o, lse = sage_attn.attention_numpy(*bad, **kw)
    oz, lsez = sage_attn.attention_numpy(*zeroed, **kw)
    o, oz = as_hnd(o, layout)[0].astype(np.float32), as_hnd(oz, layout)[0].astype(np.float32)
    rows = expected_rows(nq, nk, hq, hkv, causal, iq, jk, jv)
    assert rows.any()
    assert np.isnan(o[rows]).all() and np.isnan(lse[0][rows]).all()
    assert np.isfinite(o[~rows]).all()
    np.testing.assert_array_equal(o[~rows], oz[~rows])
    np.testing.assert_array_equal(lse[0][~rows], lsez[0][~rows])




@pytest.mark.parametrize("causal", [False, True])
def test_torch_cuda_marks_reached_rows(rng, causal):
    torch_mod = pytest.importorskip("torch")
    if not (torch_mod.cuda.is_available() and torch_mod.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("needs a CUDA GPU with sm_89 or newer")
    nq, nk, hq, hkv, d = 300, 300, 4, 2, 128
    bad, zeroed, (iq, jk, jv) = poisoned_inputs(rng, "HND", nq, nk, hq, hkv, d)
    run = lambda qkv: sage_attn.sageattn(  # noqa: E731
        *(torch_mod.from_numpy(x).cuda() for x in qkv), is_causal=causal,
        causal_align="top_left", return_lse=True)
    o, lse = (t.float().cpu().numpy() for t in run(bad))
    oz, lsez = (t.float().cpu().numpy() for t in run(zeroed))
    rows = expected_rows(nq, nk, hq, hkv, "top_left" if causal else None, iq, jk, jv)
    assert np.isnan(o[0][rows]).all() and np.isnan(lse[0][rows]).all()
    assert np.isfinite(o[0][~rows]).all()
    np.testing.assert_array_equal(o[0][~rows], oz[0][~rows])
