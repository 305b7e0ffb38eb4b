"""SageBwd through torch.autograd: sageattn's gradients against float64 autograd (CPU tensors run
the library's CPU emulation; CUDA tensors the kernels), the FlashAttention-style rule against
torch's own fp16/bf16 SDPA backward, a gradient through the returned LSE, bit-identical gradients
under torch.use_deterministic_algorithms(True), the SDPA drop-in in training,
torch.compile(fullgraph=True). GPU tests skip themselves without a CUDA device."""
import contextlib
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import sage_attn  # noqa: E402
from conftest import count_calls  # noqa: E402

HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with sm_89 or newer")
TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture
def gen(rng):
    g = torch.Generator(device="cpu")
    g.manual_seed(int(rng.integers(2**31)))
    return g


def inputs(gen, b, hq, hkv, nq, nk, d, dtype, device):
    q = torch.randn((b, hq, nq, d), generator=gen).to(dtype=dtype, device=device)
    k = torch.randn((b, hkv, nk, d), generator=gen).to(dtype=dtype, device=device)
    v = torch.randn((b, hkv, nk, d), generator=gen).to(dtype=dtype, device=device)
    do = torch.randn((b, hq, nq, d), generator=gen).to(dtype=dtype, device=device)
    return q, k, v, do


def grads64(q, k, v, do, causal, d_lse=None):
    """float64 gradients of <do, O> (+ <d_lse, LSE>) by torch autograd on the CPU; causal
    top-left (SDPA's) or bottom-right via an explicit mask."""
    q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = q64 @ kk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vv
    loss = (o * do.double().cpu()).sum()
    if d_lse is not None:
        loss = loss + (lse * d_lse.double().cpu()).sum()
    return torch.autograd.grad(loss, (q64, k64, v64))


def rel_l1(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).abs().sum() / ref.abs().sum())


def cos(x, ref):
    x, ref = x.detach().double().cpu().flatten(), ref.detach().double().cpu().flatten()
    return float(x @ ref / (x.norm() * ref.norm()))


def sage_grads(q, k, v, do, causal, **kw):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = sage_attn.sageattn(qq, kk, vv, is_causal=causal, **kw)
    o.backward(do)
    return qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_gradients_match_float64(gen, causal):
    q, k, v, do = inputs(gen, 1, 4, 2, 70, 90, 64, torch.float32, "cpu")
    got = sage_grads(q, k, v, do, causal)
    want = grads64(q, k, v, do, causal)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert cos(g, w) > 0.999
        assert rel_l1(g, w) < 0.05


def test_cpu_gradient_through_lse(gen):
    q, k, v, do = inputs(gen, 1, 2, 2, 40, 40, 64, torch.float32, "cpu")
    d_lse = torch.randn((1, 2, 40), generator=gen)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = sage_attn.sageattn(qq, kk, vv, return_lse=True)
    ((o * do).sum() + (lse * d_lse).sum()).backward()
    want = grads64(q, k, v, do, False, d_lse)
    for g, w in zip((qq.grad, kk.grad, vv.grad), want):
        assert cos(g, w) > 0.999


def test_compile_fullgraph_backward_cpu(gen):
    q, k, v, do = inputs(gen, 1, 2, 2, 33, 33, 64, torch.float32, "cpu")

    def step(q, k, v):
        return (sage_attn.sageattn(q, k, v, is_causal=True) * do).sum()

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    torch.compile(step, fullgraph=True, backend="aot_eager")(qq, kk, vv).backward()
    want = sage_grads(q, k, v, do, True)
    for g, w in zip((qq.grad, kk.grad, vv.grad), want):
        assert torch.equal(g, w)


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside, the caller's setting restored after."""
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def bits(x):
    return x.detach().view(torch.int16 if x.element_size() == 2 else torch.int32)


def test_cpu_deterministic_algorithms(gen):
    q, k, v, do = inputs(gen, 1, 2, 1, 40, 50, 64, torch.float32, "cpu")
    want = sage_grads(q, k, v, do, True)
    with deterministic_algorithms():
        got = sage_grads(q, k, v, do, True)  # the option reaches the CPU backend, which takes it
    for g, w in zip(got, want):
        assert torch.equal(bits(g), bits(w))


@gpu
@pytest.mark.parametrize("dtype,d,shape,causal", [
    (torch.bfloat16, 128, (2, 4, 2, 1000, 1000), True),
    (torch.float16, 64, (1, 4, 2, 333, 700), False),
])
def test_gpu_deterministic_algorithms_give_identical_grads(gen, dtype, d, shape, causal):
    """Under torch.use_deterministic_algorithms(True) the backward passes
    SAGE_BWD_OPTION_DETERMINISTIC (dQ summed in key-block order): two backward passes give the
    same bits, still within the issue's bar against float64."""
    b, hq, hkv, nq, nk = shape
    q, k, v, do = inputs(gen, b, hq, hkv, nq, nk, d, dtype, "cuda")
    with deterministic_algorithms():
        first = sage_grads(q, k, v, do, causal)
        second = sage_grads(q, k, v, do, causal)
    want = grads64(q, k, v, do, causal)
    for name, g1, g2, w in zip("qkv", first, second, want):
        assert torch.equal(bits(g1), bits(g2)), name
        assert cos(g1, w) > 0.999, name


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,shape,causal", [
    (64, (2, 4, 2, 1000, 1000), True),
    (128, (1, 4, 1, 513, 1700), True),   # MQA, Nq != Nk (bottom-right)
    (128, (1, 2, 2, 4096, 4096), False),
    (64, (1, 2, 2, 17, 17), False),
])
def test_gpu_gradients_flash_attention_rule(gen, dtype, d, shape, causal):
    """Error against float64 at most K times that of torch's own SDPA backward in bf16 on the same
    inputs (FlashAttention's test rule; bf16, the coarser 16-bit format, for both dtypes: torch's
    fp16 backward is ~8x more accurate than its bf16 one, and INT8 operands carry fewer bits than
    either). K = 15: the ratio measured on the H100 on N(0,1) inputs is 4.1-9.1. And cos >= 0.999
    (the issue's bar)."""
    K = 15.0
    b, hq, hkv, nq, nk = shape
    q, k, v, do = inputs(gen, b, hq, hkv, nq, nk, d, dtype, "cuda")
    got = sage_grads(q, k, v, do, causal)
    want = grads64(q, k, v, do, causal)
    # torch's SDPA in bf16 (top-left causal only: give it the bottom-right mask).
    qq, kk, vv = (x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    mask = None
    if causal:
        i = torch.arange(nq, device="cuda")[:, None]
        j = torch.arange(nk, device="cuda")[None, :]
        mask = j <= i + (nk - nq)
    o = TORCH_SDPA(qq, kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1),
                   attn_mask=mask)
    o.backward(do.to(torch.bfloat16))
    base = (qq.grad, kk.grad, vv.grad)
    for name, g, w, t in zip("qkv", got, want, base):
        assert g.dtype == dtype and g.shape == w.shape and torch.isfinite(g).all()
        ratio = rel_l1(g, w) / max(rel_l1(t, w), 1e-6)
        print(f"d{name}: sage rel-l1 {rel_l1(g, w):.4f} cos {cos(g, w):.6f}; "
              f"torch {rel_l1(t, w):.5f}; ratio {ratio:.1f}")
        assert cos(g, w) > 0.999, name
        assert ratio < K, name


@gpu
def test_gpu_gradient_through_lse_and_nhd(gen):
    q, k, v, do = inputs(gen, 1, 4, 2, 300, 300, 128, torch.bfloat16, "cuda")
    d_lse = torch.randn((1, 4, 300), generator=gen).cuda()
    qn, kn, vn = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    o, lse = sage_attn.sageattn(qn, kn, vn, tensor_layout="NHD", return_lse=True,
                                is_causal=True)
    ((o.float() * do.transpose(1, 2).float()).sum() + (lse * d_lse).sum()).backward()
    want = grads64(q, k, v, do, True, d_lse)
    for g, w in zip((qn.grad, kn.grad, vn.grad), want):
        assert cos(g.transpose(1, 2), w) > 0.999


@gpu
def test_gpu_dropin_trains_with_sage(gen):
    q, k, v, do = inputs(gen, 1, 4, 4, 8192, 8192, 128, torch.float16, "cuda")
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    # Under the crossover rule training stays with torch's SDPA (SageBwd measured slower) ...
    assert sage_attn.dropin_backend(qq, kk, vv, is_causal=True) == "sdpa"
    assert torch.equal(sage_attn.scaled_dot_product_attention(qq, kk, vv, is_causal=True),
                       TORCH_SDPA(qq, kk, vv, is_causal=True))
    # ... and without it, it trains with sage.
    sage_attn.set_dropin_crossover(False)
    try:
        assert sage_attn.dropin_backend(qq, kk, vv, is_causal=True) == "sage"
        o = sage_attn.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        o.backward(do)
    finally:
        sage_attn.set_dropin_crossover(True)
    want = sage_grads(q, k, v, do, True)  # sageattn's top-left = the same mask at Nq == Nk
    for g, w in zip((qq.grad, kk.grad, vv.grad), want):
        assert cos(g, w) > 0.99999
    # an attn_mask still goes to torch (with its backward)
    q2 = q[:, :, :64].clone().requires_grad_()
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    with pytest.warns(UserWarning, match="attn_mask"):
        sage_attn.scaled_dot_product_attention(q2, k[:, :, :64], v[:, :, :64], attn_mask=mask)


@gpu
def test_gpu_compile_fullgraph_backward(gen):
    q, k, v, do = inputs(gen, 1, 2, 2, 1000, 1000, 64, torch.float16, "cuda")

    def step(q, k, v):
        return (sage_attn.sageattn(q, k, v, is_causal=True).float() * do.float()).sum()

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    torch.compile(step, fullgraph=True)(qq, kk, vv).backward()
    want = sage_grads(q, k, v, do, True)
    for g, w in zip((qq.grad, kk.grad, vv.grad), want):
        assert cos(g, w) > 0.99999  # the same kernels (dQ's atomics may reorder its sums)


def structured(gen, kind, strength, b, hq, hkv, n, d, dtype, device):
    """N(0,1) inputs with one kind of training structure: 'outliers' (4 channels of Q and K
    times strength), 'peaked' (Q times strength: scores of that standard deviation)."""
    q, k, v, do = inputs(gen, b, hq, hkv, n, n, d, torch.float32, "cpu")
    if kind == "outliers":
        ch = torch.arange(4) * (d // 4)
        q[..., ch] *= strength
        k[..., ch] *= strength
    elif kind == "peaked":
        q *= strength
    return tuple(x.to(dtype=dtype, device=device) for x in (q, k, v, do))


@pytest.mark.parametrize("causal,layout,with_lse", [
    (False, "HND", False), (True, "NHD", False), (True, "HND", True)])
def test_cpu_check_sends_coarse_scores_to_16_bits(gen, causal, layout, with_lse):
    """Outlier channels x16: the check refuses the 8-bit gradients and the call computes them in
    16 bits by torch, with a warning and the counter; they match float64 as torch's would."""
    q, k, v, do = structured(gen, "outliers", 16.0, 1, 4, 2, 75, 64, torch.float32, "cpu")
    d_lse = torch.randn((1, 4, 75), generator=gen) if with_lse else None
    tr = (lambda x: x.transpose(1, 2).contiguous()) if layout == "NHD" else (lambda x: x)
    qq, kk, vv = (tr(x).requires_grad_() for x in (q, k, v))
    before = sage_attn.backward_fallbacks()
    with pytest.warns(sage_attn.SageBwdFallbackWarning, match="16 bits"):
        o, lse = sage_attn.sageattn(qq, kk, vv, tensor_layout=layout, is_causal=causal,
                                    return_lse=True)
        loss = (o * tr(do)).sum() + ((lse * d_lse).sum() if with_lse else 0.0)
        loss.backward()
    assert sage_attn.backward_fallbacks() == before + 1
    want = grads64(q, k, v, do, causal, d_lse)
    for g, w in zip((qq.grad, kk.grad, vv.grad), want):
        g = g.transpose(1, 2) if layout == "NHD" else g
        assert torch.isfinite(g).all()
        assert cos(g, w) > 0.99999 and rel_l1(g, w) < 1e-4


@pytest.mark.parametrize("kind,strength", [("outliers", 1.0), ("outliers", 10.0),
                                           ("peaked", 4.0), ("peaked", 20.0)])
def test_cpu_training_inputs_never_silently_wrong(gen, kind, strength):
    """Whatever path the check picks, the gradients meet the bar on the classes that broke the
    8-bit backward (peaked rows and outlier channels: cos 0.5-0.9 before it normalized its own
    scores), and plain inputs stay in 8 bits."""
    q, k, v, do = structured(gen, kind, strength, 1, 4, 1, 130, 64, torch.bfloat16, "cpu")
    before = sage_attn.backward_fallbacks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sage_attn.SageBwdFallbackWarning)
        got = sage_grads(q, k, v, do, True)
    if strength == 1.0:
        assert sage_attn.backward_fallbacks() == before
    want = grads64(q, k, v, do, True)
    for g, w in zip(got, want):
        assert cos(g, w) > 0.999


def test_cpu_repeated_refusals_skip_the_8bit_attempt(gen, monkeypatch):
    """After two refusals in a row of one kind of call, the next 2^(r-1) calls of that kind (r
    refusals in a row) go straight to 16 bits without SageBwd's attempt; an accepted attempt
    ends the run; another kind is not affected; set_backward_retry(False) tries every call.
    Every call's gradients are the 16-bit ones where 8 bits were refused or skipped."""
    from sage_attn import _torch as st
    attempts = count_calls(monkeypatch, st, "_backward_op")
    bad = structured(gen, "outliers", 16.0, 1, 4, 2, 75, 64, torch.float32, "cpu")
    plain = structured(gen, "outliers", 1.0, 1, 4, 2, 75, 64, torch.float32, "cpu")
    other = structured(gen, "outliers", 16.0, 1, 4, 2, 75, 32, torch.float32, "cpu")
    want = grads64(*bad, True)

    def call(x):
        before = len(attempts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sage_attn.SageBwdFallbackWarning)
            got = sage_grads(*x, True)
        return got, len(attempts) > before

    before = sage_attn.backward_fallbacks()
    tried = []
    for i in range(12):
        got, t = call(bad)
        tried.append(t)
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            assert cos(g, w) > 0.99999, i
    # Attempts at calls 1, 2 (then 2 skipped), 5 (then 4 skipped), 10 (then 8 skipped).
    assert [i + 1 for i, t in enumerate(tried) if t] == [1, 2, 5, 10]
    assert sage_attn.backward_fallbacks() == before + 12
    assert call(other)[1]  # another head dim: its own kind, tried
    # Skipped calls of the kind include plain inputs (a kind, not an input, is remembered) ...
    assert not call(plain)[1]
    # ... and once an attempt is accepted the run ends: every call is tried again.
    st._skips[next(k for k in st._skips if k[-1] == 64)][1] = 0
    before = sage_attn.backward_fallbacks()
    assert call(plain)[1] and call(plain)[1]
    assert sage_attn.backward_fallbacks() == before
    assert call(bad)[1]  # one refusal: not yet a run
    sage_attn.set_backward_retry(False)
    try:
        assert all(call(bad)[1] for _ in range(4))
    finally:
        sage_attn.set_backward_retry(True)


def test_cpu_fallback_runs_sdpa_unless_the_lse_has_a_gradient(gen, monkeypatch):
    """A refused call whose loss does not use the LSE gets SDPA's own backward (its fused
    kernels on a GPU), not the float32 textbook one: autograd hands the unused LSE's gradient as
    None, not as zeros."""
    import sage_attn._torch as T
    calls = []
    real = T._torch_sdpa

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(T, "_torch_sdpa", counting)
    q, k, v, do = structured(gen, "outliers", 16.0, 1, 2, 2, 64, 64, torch.float32, "cpu")
    for with_lse in (False, True):
        calls.clear()
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        with pytest.warns(sage_attn.SageBwdFallbackWarning):
            o, lse = sage_attn.sageattn(qq, kk, vv, is_causal=True, return_lse=True)
            loss = (o * do).sum() + (lse.sum() if with_lse else 0.0)
            loss.backward()
        assert len(calls) == (0 if with_lse else 1)
        want = grads64(q, k, v, do, True, torch.ones(1, 2, 64) if with_lse else None)
        for g, w in zip((qq.grad, kk.grad, vv.grad), want):
            assert cos(g, w) > 0.99999
