"""A sageattn call's device memory against the documented formula (docs/c-api.md, "Device memory"): the peak that
torch's caching allocator records over one call, above the inputs, is the output (and LSE) plus
the workspace the formula gives, within the allocator's rounding. Skips without a CUDA GPU."""
import pytest

torch = pytest.importorskip("torch")

import sage_attn  # noqa: E402

HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with sm_89 or newer")

MiB = 1 << 20
# The caching allocator rounds each request up to 512 bytes and may hand out a cached block up to
# 1 MiB larger than asked for without splitting it (o, LSE and workspace: three requests).
SLACK = 3 * (MiB + 512)


def up256(x):
    return (x + 255) // 256 * 256


def workspace_formula(B, Hq, Hkv, Nq, Nk, D, bits, prepass_q, smooth_q, lse):
    """The workspace formula of docs/c-api.md ("Device memory"), term by term."""
    nq, nk, r = -(-Nq // 128) * 128, -(-Nk // 64) * 64, D * bits // 8
    w = (up256(B * Hkv * nk * r) + up256(B * Hkv * nk // 4) + up256(B * Hkv * D * nk)
         + 6 * up256(4 * B * Hkv * D) + 256 + up256(8 * B * Hkv) + up256(4 * B * Hkv))
    if prepass_q:
        w += up256(B * Hq * nq * r) + up256(2 * B * Hq * nq)
    if smooth_q:
        w += up256(4 * B * Hq * nq * D // 128)
    if prepass_q or lse:
        w += up256(4 * B * Hq * Nq)
    return w


def peak_of_one_call(fn):
    """Bytes torch allocates at the peak of fn() above what is allocated before it."""
    fn()  # first call: the library loads, the shape is planned
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


@gpu
@pytest.mark.parametrize("qk_bits, causal, return_lse, kernel", [
    (8, False, False, None), (8, True, True, None), (8, False, True, "mma"),
    (4, True, False, None), (4, False, True, None)])
def test_peak_memory_is_output_plus_formula(qk_bits, causal, return_lse, kernel):
    # GQA 4:1, lengths off the 64/128 blocks. Here a stored ΔS (4 bytes a key per 128-query
    # block, with 4-bit's Q smoothing) would take 15 MiB, about the output's size: a workspace
    # holding it fails the bound.
    B, Hq, Hkv, Nq, Nk, D = 1, 8, 2, 8000, 8000, 128
    g = torch.Generator(device="cpu")
    g.manual_seed(0)
    q = torch.randn((B, Hq, Nq, D), generator=g).half().cuda()
    k = torch.randn((B, Hkv, Nk, D), generator=g).half().cuda()
    v = torch.randn((B, Hkv, Nk, D), generator=g).half().cuda()

    def call():
        return sage_attn.sageattn(q, k, v, is_causal=causal, return_lse=return_lse,
                                  qk_bits=qk_bits, kernel=kernel)

    peak = peak_of_one_call(call)
    smooth_q = qk_bits == 4  # on for 4-bit only by default
    # Q is quantized by the pre-pass except in the sm90 kernel (8-bit, no Q smoothing, sm_90).
    sm90 = (torch.cuda.get_device_capability() == (9, 0) and qk_bits == 8 and not smooth_q
            and kernel != "mma")
    output = 2 * B * Hq * Nq * D + (4 * B * Hq * Nq if return_lse else 0)
    ws = workspace_formula(B, Hq, Hkv, Nq, Nk, D, qk_bits, not sm90, smooth_q, return_lse)
    print(f"peak {peak / MiB:.2f} MiB, output {output / MiB:.2f} MiB + workspace "
          f"{ws / MiB:.2f} MiB")
    assert peak >= output + ws
    assert peak <= output + ws + SLACK
