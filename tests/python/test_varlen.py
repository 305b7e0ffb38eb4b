"""Packed variable-length batches through the ctypes layer: the numpy front end (CPU reference,
runs in CI without torch) and, where torch is installed, sageattn_varlen on CPU tensors and, with
a GPU, on CUDA tensors (equal to per-sequence dense sageattn calls bit for bit, close to float64,
capturable in a CUDA graph and replayable with new cu_seqlens, clear errors)."""
import warnings

import numpy as np
import pytest

import sage_attn
from conftest import count_calls, naive_attention

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
    # cu_seqlens of different counts: named as such (not as too few entries)
    with pytest.raises(ValueError, match="the same batch . 1 >= 2 entries each .got 3 and 2"):
        sage_attn.attention_varlen_numpy(q, k, v, cu_q, cu_k[[0, 2]], 8, 8)


def test_torch_cpu_matches_numpy(rng):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed(rng, LENS_Q, LENS_K, 4, 2, 64, np.float16)
    want, want_lse = sage_attn.attention_varlen_numpy(q, k, v, cu_q, cu_k, 100, 100,
                                                      is_causal=True, return_lse=True,
                                                      smooth_k=True)
    t = [torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k)]
    o, lse = sage_attn.sageattn_varlen(*t, 100, 100, is_causal=True, return_lse=True)
    assert np.array_equal(o.numpy(), want) and np.array_equal(lse.numpy(), want_lse)


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the SageAttention2 kernels need sm_89 or newer")
    return torch


# Lengths off every block size (64, 128), empty sequences of both kinds, Nq != Nk.
CUDA_LENS_Q = [1, 17, 127, 129, 0, 1000, 5, 300]
CUDA_LENS_K = [1, 129, 1000, 17, 5, 127, 0, 300]


def _cuda_packed(torch, rng, dtype, hq=4, hkv=2, d=128, lens_q=CUDA_LENS_Q, lens_k=CUDA_LENS_K):
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, hq, hkv, d, np.float32)
    t = [torch.from_numpy(x).to("cuda", dtype) for x in (q, k, v)]
    return t + [torch.from_numpy(x).cuda() for x in (cu_q, cu_k)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("qk_bits", [8, 4])
@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
def test_cuda_equals_dense_calls_and_float64(rng, dtype, qk_bits, causal):
    torch = _cuda_torch()
    dt = getattr(torch, dtype)
    q, k, v, cu_q, cu_k = _cuda_packed(torch, rng, dt)
    o, lse = sage_attn.sageattn_varlen(q, k, v, cu_q, cu_k, max(CUDA_LENS_Q), max(CUDA_LENS_K),
                                       is_causal=causal is not None,
                                       causal_align=causal or "bottom_right", return_lse=True,
                                       qk_bits=qk_bits, kernel="mma")
    assert o.shape == q.shape and o.dtype == dt and lse.shape == (4, q.shape[0])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(CUDA_LENS_Q)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if CUDA_LENS_Q[b] == 0:
            continue
        if CUDA_LENS_K[b] == 0:
            assert (o[qs] == 0).all() and (lse[:, qs] == -float("inf")).all()
            continue
        # The same family's dense call on this sequence alone: the same bits.
        do, dl = sage_attn.sageattn(q[None, qs], k[None, ks], v[None, ks], tensor_layout="NHD",
                                    is_causal=causal is not None,
                                    causal_align=causal or "bottom_right", return_lse=True,
                                    qk_bits=qk_bits, kernel="mma")
        assert torch.equal(o[qs], do[0]), f"sequence {b}"
        assert torch.equal(lse[:, qs], dl[0]), f"sequence {b}"
        # And float64 truth, loosely.
        ref, ref_lse = naive_attention(q[None, qs].double().cpu().numpy(),
                                       k[None, ks].double().cpu().numpy(),
                                       v[None, ks].double().cpu().numpy(), "NHD", causal)
        m = sage_attn.metrics(o[qs].float().cpu().numpy(), ref[0])
        if qk_bits == 8:
            assert m["cos"] > 0.999 and m["rel_l1"] < 0.06, (b, m)
        else:  # 4-bit on N(0,1) queries: cos ~0.98 (0.982 measured on an H200), as dense
            assert m["cos"] > 0.97 and m["rel_l1"] < 0.25, (b, m)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
def test_cuda_sm90_packed_equals_dense_sm90_calls(rng, dtype, causal):
    torch = _cuda_torch()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel runs on sm_90 only")
    dt = getattr(torch, dtype)
    q, k, v, cu_q, cu_k = _cuda_packed(torch, rng, dt, d=64)
    kw = dict(is_causal=causal is not None, causal_align=causal or "bottom_right",
              return_lse=True, kernel="sm90")
    o, lse = sage_attn.sageattn_varlen(q, k, v, cu_q, cu_k, max(CUDA_LENS_Q), max(CUDA_LENS_K),
                                       **kw)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(CUDA_LENS_Q)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if CUDA_LENS_Q[b] == 0 or CUDA_LENS_K[b] == 0:
            continue
        do, dl = sage_attn.sageattn(q[None, qs], k[None, ks], v[None, ks], tensor_layout="NHD",
                                    **kw)
        assert torch.equal(o[qs], do[0]) and torch.equal(lse[:, qs], dl[0]), f"sequence {b}"


@pytest.mark.parametrize("kernel", [None, "sm90"])
def test_cuda_graph_capture_replays_with_new_cu_seqlens(rng, kernel):
    torch = _cuda_torch()
    lens_q, lens_k = [100, 300, 7, 600], [50, 300, 900, 10]
    if kernel == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel runs on sm_90 only")
    q, k, v, cu_q, cu_k = _cuda_packed(torch, rng, torch.float16, lens_q=lens_q, lens_k=lens_k)
    total_q, total_k = q.shape[0], k.shape[0]
    max_q = max_k = 1000  # bounds every layout replayed below

    def call():
        return sage_attn.sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True,
                                         return_lse=True, kernel=kernel)

    eager_o, eager_lse = call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up outside the capture (plans, kernel attributes)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, glse = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(go, eager_o) and torch.equal(glse, eager_lse)
    # New lengths, same batch size and totals: the replay reads the new cu_seqlens on the device.
    new_q, new_k = [400, 1, 299, 307], [900, 60, 200, 100]
    assert sum(new_q) == total_q and sum(new_k) == total_k
    cu_q.copy_(torch.tensor(np.concatenate([[0], np.cumsum(new_q)]), dtype=torch.int32))
    cu_k.copy_(torch.tensor(np.concatenate([[0], np.cumsum(new_k)]), dtype=torch.int32))
    graph.replay()
    want_o, want_lse = call()  # eager, with the new contents
    torch.cuda.synchronize()
    assert torch.equal(go, want_o) and torch.equal(glse, want_lse)
    assert not torch.equal(go, eager_o)


def test_cuda_errors_name_the_argument(rng):
    torch = _cuda_torch()
    q, k, v, cu_q, cu_k = _cuda_packed(torch, rng, torch.float16, lens_q=[3, 8], lens_k=[4, 8])
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        sage_attn.sageattn_varlen(q, k, v, cu_q, cu_k.long(), 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        sage_attn.sageattn_varlen(q, k, v, cu_q.cpu(), cu_k, 8, 8)
    with pytest.raises(ValueError, match="v"):
        sage_attn.sageattn_varlen(q, k, v.cpu(), cu_q, cu_k, 8, 8)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        sage_attn.sageattn_varlen(q, k, v, cu_q, cu_k, 8.0, 8)


def _varlen_grads_vs_dense(torch, q, k, v, cu_q, cu_k, lens_q, lens_k, causal, with_lse, gen):
    """sageattn_varlen's gradients next to each sequence's dense sageattn call (NHD [1, n, H, D],
    the same inputs): (packed grads, list of (slices, dense grads or None))."""
    hq = q.shape[1]
    d_o = torch.randn(q.shape, generator=gen).to(q.device, q.dtype)
    d_lse = torch.randn((hq, q.shape[0]), generator=gen).to(q.device) if with_lse else None
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, lse = sage_attn.sageattn_varlen(qq, kk, vv, cu_q, cu_k, max(lens_q), max(lens_k),
                                       is_causal=causal, return_lse=True)
    loss = (o.float() * d_o.float()).sum()
    if with_lse:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * d_lse).sum()
    loss.backward()
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    dense = []
    for b in range(len(lens_q)):
        qs, ks = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        if lens_q[b] == 0 or lens_k[b] == 0:
            dense.append(((qs, ks), None))
            continue
        x = [t[s].detach().clone().unsqueeze(0).requires_grad_() for t, s in
             ((q, qs), (k, ks), (v, ks))]
        od, ld = sage_attn.sageattn(*x, tensor_layout="NHD", is_causal=causal, return_lse=True)
        dl = (od.float() * d_o[qs].unsqueeze(0).float()).sum()
        if with_lse:
            dl = dl + (torch.where(torch.isfinite(ld), ld, 0.0) * d_lse[:, qs].unsqueeze(0)).sum()
        dl.backward()
        dense.append(((qs, ks), [t.grad[0] for t in x]))
    return (qq.grad, kk.grad, vv.grad), dense


def _expect_dense_bits(torch, grads, dense):
    """Each sequence's packed gradients are its dense call's bit for bit (zero where the
    sequence has no query or no key)."""
    gq, gk, gv = grads
    for (qs, ks), want in dense:
        if want is None:
            assert (gq[qs] == 0).all() and (gk[ks] == 0).all() and (gv[ks] == 0).all()
            continue
        for got, w in zip((gq[qs], gk[ks], gv[ks]), want):
            assert torch.equal(got, w)


@pytest.mark.parametrize("causal,with_lse", [(False, False), (True, True)])
def test_cpu_backward_is_each_sequences_dense_backward(rng, causal, with_lse):
    """Per sequence, bit for bit the dense call's gradients (the CPU reference is
    deterministic); sequences without queries or keys get zero gradients."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in
                           packed(rng, LENS_Q, LENS_K, 4, 2, 64, np.float32))
    _expect_dense_bits(torch, *_varlen_grads_vs_dense(torch, q, k, v, cu_q, cu_k, LENS_Q,
                                                      LENS_K, causal, with_lse, gen))


def _outliers_in_sequence_1(torch, rng):
    """Three packed sequences (40, 90, 64 tokens; 2 heads, D 64, float32) whose second has four
    channels of Q and K x16, which SageBwd's check refuses: lens, q, k, v, cu_q, cu_k."""
    lens = [40, 90, 64]
    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in packed(rng, lens, lens, 2, 2, 64,
                                                                np.float32))
    ch = torch.arange(4) * 16
    for x in (q, k):
        x[40:130, :, ch] *= 16.0
    return lens, q, k, v, cu_q, cu_k


def test_cpu_backward_refuses_one_sequence_alone(rng):
    """A sequence with outlier channels x16 goes to 16 bits; its neighbours stay SageBwd's."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    lens, q, k, v, cu_q, cu_k = _outliers_in_sequence_1(torch, rng)
    before = sage_attn.backward_fallbacks()
    with pytest.warns(sage_attn.SageBwdFallbackWarning):
        (gq, gk, gv), dense = _varlen_grads_vs_dense(torch, q, k, v, cu_q, cu_k, lens, lens, True,
                                                     False, gen)
    assert sage_attn.backward_fallbacks() == before + 2  # the packed call's and the dense one's
    for b, ((qs, ks), want) in enumerate(dense):
        for got, w in zip((gq[qs], gk[ks], gv[ks]), want):
            assert torch.isfinite(got).all()
            assert torch.equal(got, w) if b != 1 else torch.allclose(got, w, rtol=0, atol=1e-5)


def test_cpu_backward_repeated_refusals_go_straight_to_16_bits(rng, monkeypatch):
    """A packed call is one call of its kind for set_backward_retry: after two refused in a row,
    the next call runs every sequence in 16 bits directly (no SageBwd launch), counted per
    sequence, with the 16-bit gradients."""
    torch = pytest.importorskip("torch")
    from sage_attn import _torch as st
    launches = count_calls(monkeypatch, st, "_launch_backward")
    lens, q, k, v, cu_q, cu_k = _outliers_in_sequence_1(torch, rng)
    d_o = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32))
    grads, counts, fallbacks = [], [], []
    for _ in range(3):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        before, n = sage_attn.backward_fallbacks(), len(launches)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sage_attn.SageBwdFallbackWarning)
            o = sage_attn.sageattn_varlen(qq, kk, vv, cu_q, cu_k, max(lens), max(lens),
                                          is_causal=True)
            o.backward(d_o)
        grads.append((qq.grad, kk.grad, vv.grad))
        counts.append(len(launches) - n)
        fallbacks.append(sage_attn.backward_fallbacks() - before)
    assert counts == [3, 3, 0]
    assert fallbacks == [1, 1, 3]
    for got, first in zip(grads[2], grads[0]):
        assert torch.isfinite(got).all()
        assert torch.allclose(got[40:130], first[40:130], rtol=0, atol=1e-5)  # 16 bits both
        for s in (slice(0, 40), slice(130, 194)):  # SageBwd's in the first call
            a, b = got[s].double().flatten(), first[s].double().flatten()
            assert float(a @ b / (a.norm() * b.norm())) > 0.999


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_backward_is_each_sequences_dense_backward(rng, dtype):
    """On the GPU under torch.use_deterministic_algorithms(True) (dQ summed in a fixed order):
    bit for bit the dense calls' gradients, lengths off every block size."""
    torch = _cuda_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v, cu_q, cu_k = _cuda_packed(torch, rng, getattr(torch, dtype))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = _varlen_grads_vs_dense(torch, q, k, v, cu_q, cu_k, CUDA_LENS_Q, CUDA_LENS_K, True,
                                     True, gen)
    finally:
        torch.use_deterministic_algorithms(was)
    _expect_dense_bits(torch, *got)
