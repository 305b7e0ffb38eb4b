"""Packed variable-length batches through the ctypes layer: the numpy front end (CPU reference,
runs in CI without torch) and, where torch is installed, sageattn_varlen on CPU tensors and its
refusal of CUDA tensors."""
import numpy as np
import pytest

import sage_attn
from conftest import naive_attention

LENS_Q, LENS_K = [1, 17, 100, 0, 9], [17, 1, 100, 5, 0]


def packed(rng, lens_q, lens_k, hq, hkv, d, dtype):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
def test_exact_matches_naive_per_sequence(rng, causal):
    q, k, v, cu_q, cu_k = packed(rng, LENS_Q, LENS_K, 4, 2, 32, np.float32)
    o, lse = sage_attn.attention_varlen_numpy(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), is_causal=causal is not None,
        causal_align=causal or "bottom_right", return_lse=True, exact=True, sm_scale=0.3)
    assert o.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == np.float32
    for b in range(len(LENS_Q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENS_Q[b] == 0:
            continue
        if LENS_K[b] == 0:  # no key: a fully masked row, as in the dense call
            assert (o[qs] == 0).all() and (lse[:, qs] == -np.inf).all()
            continue
        ref, ref_lse = naive_attention(q[None, qs], k[None, ks], v[None, ks], "NHD", causal, 0.3)
        np.testing.assert_allclose(o[qs], ref[0], rtol=1e-5, atol=1e-5)
        live = np.isfinite(ref_lse[0])
        np.testing.assert_allclose(lse[:, qs][live], ref_lse[0][live], rtol=1e-5, atol=1e-5)
        assert (lse[:, qs][~live] == -np.inf).all()


@pytest.mark.parametrize("qk_bits", [8, 4])
def test_emulation_equals_dense_calls_bitwise(rng, qk_bits):
    q, k, v, cu_q, cu_k = packed(rng, LENS_Q, LENS_K, 4, 1, 64, np.float16)
    o, lse = sage_attn.attention_varlen_numpy(q, k, v, cu_q, cu_k, 100, 100, is_causal=True,
                                              return_lse=True, qk_bits=qk_bits)
    for b in range(len(LENS_Q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENS_Q[b] == 0 or LENS_K[b] == 0:
            continue
        do, dl = sage_attn.attention_numpy(q[None, qs], k[None, ks], v[None, ks], "NHD",
                                           is_causal=True, return_lse=True, qk_bits=qk_bits)
        assert np.array_equal(o[qs], do[0])
        assert np.array_equal(lse[:, qs], dl[0])


def test_errors_name_the_argument(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 8], [4, 8], 2, 2, 16, np.float16)
    bad = cu_k.copy()
    bad[1] = 13
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        sage_attn.attention_varlen_numpy(q, k, v, cu_q, bad, 8, 8)
    with pytest.raises(ValueError, match="seq_q"):
        sage_attn.attention_varlen_numpy(q, k, v, cu_q, cu_k, 7, 8)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        sage_attn.attention_varlen_numpy(q, k, v, cu_q.astype(np.int64), cu_k, 8, 8)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        sage_attn.attention_varlen_numpy(q, k, v, cu_q, cu_k, 8, 8.0)
    with pytest.raises(ValueError, match="dimensions"):
        sage_attn.attention_varlen_numpy(q[None], k, v, cu_q, cu_k, 8, 8)


def test_torch_cpu_and_cuda_refusal(rng):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed(rng, LENS_Q, LENS_K, 4, 2, 64, np.float16)
    want, want_lse = sage_attn.attention_varlen_numpy(q, k, v, cu_q, cu_k, 100, 100,
                                                      is_causal=True, return_lse=True,
                                                      smooth_k=True)
    t = [torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k)]
    o, lse = sage_attn.sageattn_varlen(*t, 100, 100, is_causal=True, return_lse=True)
    assert np.array_equal(o.numpy(), want) and np.array_equal(lse.numpy(), want_lse)
    if torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="no GPU kernel"):
            sage_attn.sageattn_varlen(*[x.cuda() for x in t], 100, 100)
