"""The benchmark's torch side that runs without a GPU: the FP8 quantization the cuDNN anchor is
fed with, and that the anchor refuses (with its own error, which the bench prints as a null row)
what it cannot run. Skips without torch."""
import pytest

torch = pytest.importorskip("torch")

from sage_attn import _bench_cudnn  # noqa: E402


def test_quantize_e4m3_round_trip():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn((2, 3, 64, 16), generator=g) * 5).half()
    x8, descale = _bench_cudnn.quantize_e4m3(x)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (1, 1, 1, 1)
    back = x8.float() * descale
    assert torch.isfinite(back).all()
    assert back.abs().max() == pytest.approx(x.float().abs().max().item(), rel=1e-3)
    # E4M3 keeps 3 mantissa bits: relative error at most 2^-4 above the subnormal range.
    big = x.float().abs() > 1e-2 * x.float().abs().max()
    rel = ((back - x.float()).abs() / x.float().abs())[big]
    assert rel.max() <= 2.0 ** -4 + 1e-6


def test_quantize_e4m3_zero_tensor():
    x8, descale = _bench_cudnn.quantize_e4m3(torch.zeros((1, 1, 4, 16), dtype=torch.float16))
    assert torch.isfinite(descale).all() and (x8.float() == 0).all()


def test_anchor_refuses_cpu_tensors():
    q = torch.zeros((1, 1, 16, 64), dtype=torch.float16)
    with pytest.raises(_bench_cudnn.CudnnFp8Unavailable):
        _bench_cudnn.CudnnFp8Attention(q, q, q, causal=False)
