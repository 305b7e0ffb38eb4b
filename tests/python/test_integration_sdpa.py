"""torch's SDPA running sage: the scoped switch `sage_attn.sdpa()` and the "sage" impl of
torch.nn.attention's flash-attention registry. CPU tests check the switch and the registered
kernels' contract (on the CPU reference); GPU tests skip without a CUDA GPU (sm_89+)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import sage_attn  # noqa: E402
from sage_attn import _sdpa, _torch as _t  # noqa: E402
from conftest import naive_attention  # noqa: E402

HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with sm_89 or newer")


def test_switch_swaps_and_restores():
    original = F.scaled_dot_product_attention
    with sage_attn.sdpa():
        assert F.scaled_dot_product_attention is sage_attn.scaled_dot_product_attention
        with sage_attn.sdpa():  # nested: the inner exit leaves the outer's switch on
            pass
        assert F.scaled_dot_product_attention is sage_attn.scaled_dot_product_attention
    assert F.scaled_dot_product_attention is original
    with pytest.raises(KeyError):
        with sage_attn.sdpa():
            raise KeyError("inside")
    assert F.scaled_dot_product_attention is original


def test_switch_restores_what_was_there():
    # Whatever function was installed before the block comes back, not torch's own.
    def mine(*args, **kwargs):
        return original(*args, **kwargs)

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = mine
    try:
        with sage_attn.sdpa():
            assert F.scaled_dot_product_attention is not mine
        assert F.scaled_dot_product_attention is mine
    finally:
        F.scaled_dot_product_attention = original


def test_registered_with_torch():
    if not _sdpa.flash_registry_available():
        pytest.skip("this torch has no torch.nn.attention flash-attention registry")
    assert "sage" in torch.nn.attention.list_flash_attention_impls()
    # Registered, not active: activation is the user's call.
    assert torch.nn.attention.current_flash_attention_impl() != "sage"


@pytest.fixture
def cpu_kernels(monkeypatch):
    monkeypatch.setattr(_sdpa, "_cpu_for_tests", True)


def _inputs(rng, B, Hq, Hkv, Nq, Nk, D, bnhd):
    """fp32 CPU tensors [B,H,N,D]; bnhd: views of [B,N,H,D] memory, as a model's projections
    give them."""
    def make(H, N):
        x = torch.from_numpy(rng.standard_normal((B, N, H, D)).astype(np.float32))
        return x.transpose(1, 2) if bnhd else x.transpose(1, 2).contiguous()
    return make(Hq, Nq), make(Hkv, Nk), make(Hkv, Nk)


@pytest.mark.parametrize("bnhd", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_forward_contract(rng, cpu_kernels, bnhd, causal):
    # The registered forward's return is the op's: 9 values, the output in the query's dimension
    # order (as the meta function allocates it), the LSE [B,H,Nq] fp32, flash's bottom-right
    # causal mask. Values: the 8-bit algorithm against float64.
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 24, 40, 32
    q, k, v = _inputs(rng, B, Hq, Hkv, Nq, Nk, D, bnhd)
    before = [x.clone() for x in (q, k, v)]
    out = _sdpa._flash_forward(None, q, k, v, 0.0, causal, False, scale=None)
    assert len(out) == 9
    o, lse, cq, ck, mq, mk, seed, offset, debug = out
    assert o.shape == q.shape and o.stride() == torch.empty_like(q).stride()
    assert lse.shape == (B, Hq, Nq) and lse.dtype == torch.float32
    assert (cq, ck, mq, mk) == (None, None, Nq, Nk)
    assert seed.shape == (2,) and seed.dtype == torch.uint64 and offset.shape == ()
    assert debug.numel() == 0
    ref_o, ref_lse = naive_attention(q.numpy(), k.numpy(), v.numpy(),
                                     causal="bottom_right" if causal else None)
    o64 = o.double().numpy()
    rel = np.abs(o64 - ref_o).sum() / np.abs(ref_o).sum()
    assert rel < 0.06, rel  # (sage-8b on N(0,1): rel-L1 ~0.035, docs/performance.md)
    assert np.abs(lse.double().numpy() - ref_lse).max() < 0.05  # (the INT8 scores: as test_torch_api)
    for x, y in zip((q, k, v), before):
        assert torch.equal(x, y)


@pytest.mark.parametrize("bnhd", [False, True])
def test_flash_backward_contract(rng, cpu_kernels, bnhd):
    # The registered backward: SageBwd's gradients (the CPU reference's emulation), in the
    # inputs' dimension order (the meta function's empty_like), against float64 autograd.
    B, Hq, Hkv, N, D = 1, 4, 2, 32, 32
    q, k, v = _inputs(rng, B, Hq, Hkv, N, N, D, bnhd)
    d_o = torch.from_numpy(rng.standard_normal((B, Hq, N, D)).astype(np.float32))
    o, lse, *_ = _sdpa._flash_forward(None, q, k, v, 0.0, True, False, scale=None)
    dq, dk, dv = _sdpa._flash_backward(None, d_o, q, k, v, o, lse, None, None, N, N, 0.0, True,
                                       None, None, scale=None)
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.stride() == torch.empty_like(x).stride()
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o.double())
    for g, r in zip((dq, dk, dv), ref_grads):
        cos = F.cosine_similarity(g.double().flatten(), r.flatten(), dim=0).item()
        assert cos > 0.99, cos


@gpu
def test_gpu_flash_impl_runs_sage_and_falls_back(rng):
    if not _sdpa.flash_registry_available():
        pytest.skip("this torch has no torch.nn.attention flash-attention registry")
    from torch.nn.attention import (SDPBackend, activate_flash_attention_impl,
                                    restore_flash_attention_impl, sdpa_kernel)
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))

    def make(shape):
        return torch.randn(shape, generator=g).to("cuda", torch.float16)

    long = [make((1, 16, 16384, 128)) for _ in range(3)]  # sage's side of the crossover
    short = [make((1, 8, 512, 128)) for _ in range(3)]    # torch's side
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        torch_short = F.scaled_dot_product_attention(*short, is_causal=True)
        torch_long = F.scaled_dot_product_attention(*long, is_causal=True)
    activate_flash_attention_impl("sage")
    try:
        assert torch.nn.attention.current_flash_attention_impl() == "sage"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            got_long = F.scaled_dot_product_attention(*long, is_causal=True)
            got_short = F.scaled_dot_product_attention(*short, is_causal=True)
    finally:
        restore_flash_attention_impl()
    if torch.cuda.get_device_capability() != (9, 0):
        # A kind of GPU the crossover model has no measurements of: every call stays with
        # torch's own flash kernel.
        assert sage_attn.dropin_backend(*long, is_causal=True) == "sdpa"
        assert torch.equal(got_long, torch_long)
    else:
        assert sage_attn.dropin_backend(*long, is_causal=True) == "sage"
        # (the registered forward always computes the LSE, the op returns one)
        assert torch.equal(got_long,
                           sage_attn.sageattn(*long, is_causal=True, return_lse=True)[0])
        assert not torch.equal(got_long, torch_long)
        rel = ((got_long.float() - torch_long.float()).abs().sum() /
               torch_long.float().abs().sum())
        assert rel < 0.05, rel
    assert sage_attn.dropin_backend(*short, is_causal=True) == "sdpa"
    assert torch.equal(got_short, torch_short)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # restored: torch's kernel again
        assert torch.equal(F.scaled_dot_product_attention(*long, is_causal=True), torch_long)


@gpu
def test_gpu_flash_impl_training(rng):
    # Training calls under the activated impl: SageBwd where the table has sage's backward
    # faster (crossover off sends every call with a backward kernel to sage), gradients close to
    # float32 SDPA's.
    if not _sdpa.flash_registry_available():
        pytest.skip("this torch has no torch.nn.attention flash-attention registry")
    from torch.nn.attention import (SDPBackend, activate_flash_attention_impl,
                                    restore_flash_attention_impl, sdpa_kernel)
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn((2, 8, 2048, 64), generator=g).to("cuda", torch.bfloat16)
               .requires_grad_() for _ in range(3))
    d_o = torch.randn((2, 8, 2048, 64), generator=g).to("cuda", torch.bfloat16)
    sage_attn.set_dropin_crossover(False)
    activate_flash_attention_impl("sage")
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(o, (q, k, v), d_o)
    finally:
        restore_flash_attention_impl()
        sage_attn.set_dropin_crossover(True)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), d_o.float())
    assert F.cosine_similarity(o.float().flatten(), ref.flatten(), dim=0) > 0.999
    for gr, r in zip(grads, ref_grads):
        assert F.cosine_similarity(gr.float().flatten(), r.flatten(), dim=0) > 0.99



def test_flash_route_hands_short_calls_to_torch_unplanned(monkeypatch):
    """The registered flash op's route: once a plan on the device has said its least routed
    length, a shorter query is torch's without asking the crossover again; a longer one, or any
    with the crossover off, still asks it."""
    from conftest import load_tool
    host = load_tool("dropin_host")
    q, k, v = (torch.randn(1, 4, 32, 64, dtype=torch.float16) for _ in range(3))
    longer = [torch.randn(1, 4, 96, 64, dtype=torch.float16) for _ in range(3)]
    asked = []
    real = _t._dropin_route
    with host.cuda_stand_in(prefer_sdpa=lambda a: a.seq_q < 64, sdpa_below=64):
        monkeypatch.setattr(_t, "_dropin_route", lambda *a, **kw: asked.append(1) or real(*a, **kw))
        assert _sdpa._route(q, k, v, 0.0, False, None, False) is None  # first: planned, torch's
        assert len(asked) == 1
        for _ in range(3):
            assert _sdpa._route(q, k, v, 0.0, False, None, False) is None
        assert len(asked) == 1
        assert _sdpa._route(*longer, 0.0, False, None, False) is not None  # sage's
        assert len(asked) == 2
        sage_attn.set_dropin_crossover(False)
        try:
            assert _sdpa._route(q, k, v, 0.0, False, None, False) is not None
        finally:
            sage_attn.set_dropin_crossover(True)
        assert len(asked) == 3
