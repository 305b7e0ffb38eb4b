"""Random calls on the GPU against the CPU emulation of what each one runs and against float64:
shapes drawn off the block grid (Nq and Nk from 1 to ~2k, every head dim the kernels take, GQA
and MQA, both causal alignments with Nq above and below Nk), both dtypes and layouts, strided
views, and inputs with the structure real models have (channel biases, outlier channels, an
attention sink, peaked rows, very large and very small values). Each case prints its draw; a
failing one is repeated with SAGE_TEST_SEED. Without a GPU (sm_89 or newer) the file skips."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sage_attn  # noqa: E402
from conftest import naive_attention  # noqa: E402
from test_torch_api import HAS_GPU, call_emulation, metrics  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with sm_89 or newer")

CLASSES = ("normal", "bias", "outliers", "sink", "peaked", "large", "small")
# B·Hq·Nq·Nk·D of one case: the emulation of a case takes a few seconds at most on the CPU.
BUDGET = 1.5e9


def draw(rng):
    """One call: shape, dtype, layout, mask, scale, kernel, input class, strided or not."""
    while True:
        d = int(rng.choice([64, 128, 64, 128, 256] + [8 * int(rng.integers(1, 33))]))
        hkv = int(rng.integers(1, 4))
        hq = hkv * int(rng.choice([1, 1, 2, 4, 8]))
        b = int(rng.integers(1, 3))
        # Lengths: uniform up to ~2k, or a small one, or one next to a multiple of 128.
        def length():
            kind = rng.integers(3)
            if kind == 0:
                return int(rng.integers(1, 33))
            if kind == 1:
                return int(128 * rng.integers(1, 16) + rng.integers(-2, 3))
            return int(rng.integers(1, 2048))
        nq, nk = max(1, length()), max(1, length())
        if b * hq * nq * nk * d <= BUDGET:
            break
    return dict(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d,
                dtype=[torch.float16, torch.bfloat16][rng.integers(2)],
                layout=["HND", "NHD"][rng.integers(2)],
                causal=[None, None, "bottom_right", "top_left"][rng.integers(4)],
                scale=None if rng.random() < 0.7 else float(rng.uniform(0.02, 0.3)),
                kernel=None if rng.random() < 0.75 else "mma",
                cls=CLASSES[rng.integers(len(CLASSES))],
                strided=bool(rng.random() < 0.5),
                seed=int(rng.integers(2**31)))


def inputs(c):
    """q, k, v as float32 [B, H, N, D] (HND) of the case's class."""
    g = torch.Generator().manual_seed(c["seed"])
    b, hq, hkv, nq, nk, d = (c[x] for x in ("b", "hq", "hkv", "nq", "nk", "d"))
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    cls = c["cls"]
    if cls == "bias":  # per-channel offsets: large in K, moderate in Q and V
        q += 2 * torch.randn(1, hq, 1, d, generator=g)
        k += 8 * torch.randn(1, hkv, 1, d, generator=g)
        v += 4 * torch.randn(1, hkv, 1, d, generator=g)
    elif cls == "outliers":  # a few channels of Q and K ten times the rest
        ch = torch.randperm(d, generator=g)[:max(1, d // 32)]
        q[..., ch] *= 10
        k[..., ch] *= 10
    elif cls == "sink":  # key 0 along the mean query direction, eight times a key's norm
        direction = q.reshape(b, hkv, hq // hkv, nq, d).mean(dim=(0, 2, 3))
        direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        k[:, :, 0] = 8 * d ** 0.5 * direction
    elif cls == "peaked":  # scores with a standard deviation of about 12: near one-hot rows
        q *= 12
    elif cls == "large":  # large values; scores' standard deviation 16 (INT8 holds cos 0.99 to
        # about 300, the error growing with it: docs/status.md)
        q, k, v = q * 4, k * 4, v * 300
    elif cls == "small":
        q, k, v = q * 1e-2, k * 1e-2, v * 1e-3
    return q, k, v


def to_call(x, c):
    """x (float32 HND) as the case's tensor: its dtype and layout on the GPU, a strided view of a
    wider buffer when the case says so (a token stride past the row, or heads taken from more)."""
    dt = c["dtype"]
    if c["layout"] == "NHD":
        x = x.transpose(1, 2)
    if c["strided"]:
        wide = torch.zeros(*x.shape[:-2], x.shape[-2] + 1, x.shape[-1] + 8, dtype=dt,
                           device="cuda")
        wide[..., : x.shape[-2], : x.shape[-1]] = x.to(device="cuda", dtype=dt)
        return wide[..., : x.shape[-2], : x.shape[-1]]
    return x.to(device="cuda", dtype=dt).contiguous()


@pytest.mark.parametrize("case", range(40))
def test_gpu_random_call_matches_emulation_and_float64(rng, case):
    c = draw(rng)
    print(c)
    q32, k32, v32 = inputs(c)
    q, k, v = (to_call(x, c) for x in (q32, k32, v32))
    before = [x.clone() for x in (q, k, v)]
    o, lse = sage_attn.sageattn(q, k, v, tensor_layout=c["layout"], is_causal=c["causal"] is not None,
                                causal_align=c["causal"] or "bottom_right", sm_scale=c["scale"],
                                return_lse=True, kernel=c["kernel"])
    torch.cuda.synchronize()
    # Nothing the caller owns changes; the output has the caller's layout, dtype and shape.
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), before)), c
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (c["b"], c["hq"], c["nq"])
    hnd = (lambda x: x.transpose(1, 2)) if c["layout"] == "NHD" else (lambda x: x)
    o_h = hnd(o)
    # The emulation of the plan of this very call (its kernel, tile, groups, accumulator).
    emu, emu_lse, kernel = call_emulation(hnd(q), hnd(k), hnd(v), c["causal"], c["scale"],
                                          kernel=c["kernel"], return_lse=True, return_kernel=True)
    assert torch.isfinite(o).all(), c
    err = metrics(o_h, emu)["rel_l1"]
    assert err < 5e-4, (c, err)
    live = torch.isfinite(emu_lse)
    got = lse.cpu()
    assert torch.equal(torch.isfinite(got), live), c
    # float64 of the same rounded inputs (each row's largest weight too, for the LSE's bound).
    ref, ref_lse, w_max = naive_attention(*(hnd(x).float().cpu().numpy() for x in (q, k, v)),
                                          "HND", c["causal"], c["scale"], max_weight=True)
    dl = (got[live].double() - emu_lse[live].double()).abs()
    tol = 2e-3 + 1e-5 * emu_lse[live].double().abs()
    if kernel == sage_attn._lib.KERNEL_SM90:
        # Its l sums P^, and its ex2.approx may round a P^ on an E4M3 tie the other way from the
        # emulation's exp2, moving that key's weight by up to 1/8 (tests/gpu, GpuVsEmulation).
        tol = tol + 0.25 * torch.from_numpy(w_max)[live]
    assert bool((dl <= tol).all()), (c, float(dl.max()))
    # Against float64: an 8-bit kernel's error, not another result.
    ref = torch.from_numpy(ref)
    if float(ref.abs().max()) > 0:
        m = metrics(o_h, ref)
        assert m["cos"] > 0.99, (c, m)
    assert np.array_equal(np.isfinite(ref_lse), live.numpy()), c


@pytest.mark.parametrize("case", range(16))
def test_gpu_random_sdpa_dropin_call(rng, case):
    """The SDPA drop-in, running sage wherever it can (its crossover set aside), on random calls
    in torch's [B, H, N, D] (the NHD cases as transposed views): torch's semantics (top-left
    causal, enable_gqa, scale), against torch's own attention in float64 of the same inputs."""
    c = draw(rng)
    print(c)
    hnd = (lambda x: x.transpose(1, 2)) if c["layout"] == "NHD" else (lambda x: x)
    q, k, v = (hnd(to_call(x, c)) for x in inputs(c))
    causal = c["causal"] is not None
    gqa = c["hq"] != c["hkv"]
    sage_attn.set_dropin_crossover(False)
    try:
        with torch.no_grad():
            got = sage_attn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                         scale=c["scale"], enable_gqa=gqa)
    finally:
        sage_attn.set_dropin_crossover(True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, scale=c["scale"], enable_gqa=gqa)
    assert got.shape == want.shape and got.dtype == q.dtype, c
    assert torch.isfinite(got).all(), c
    if float(want.abs().max()) > 0:
        m = metrics(got, want)
        assert m["cos"] > 0.99, (c, m)
