"""sage_attn.sageattn3 (SageAttention3's FP4 attention): on CPU tensors the emulation equals
attention_numpy with the SAGE3_FP4 preset; on CUDA tensors (where present) the GPU path matches
the CPU emulation tightly; it refuses inputs that require grad."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import sage_attn  # noqa: E402
from sage_attn import _lib  # noqa: E402


def inputs(gen, device, nq=150, nk=210, d=64):
    mk = lambda n, h: torch.randn(1, h, n, d, generator=gen).to(torch.float16).to(device)  # noqa
    return mk(nq, 4), mk(nk, 2), mk(nk, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_is_the_sage3_emulation(causal):
    gen = torch.Generator().manual_seed(7)
    q, k, v = inputs(gen, "cpu")
    o, lse = sage_attn.sageattn3(q, k, v, is_causal=causal, return_lse=True)
    cfg = _lib.preset(_lib.VARIANT_SAGE3_FP4)
    want = sage_attn.attention_numpy(q.numpy(), k.numpy(), v.numpy(), is_causal=causal,
                                     return_lse=True, quant=cfg)
    np.testing.assert_array_equal(o.numpy(), want[0])
    np.testing.assert_array_equal(lse.numpy(), want[1])


def test_refuses_grad():
    q, k, v = inputs(torch.Generator().manual_seed(1), "cpu")
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="no backward"):
        sage_attn.sageattn3(q, k, v)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA GPU with sm_89 or newer")
def test_cuda_matches_cpu_emulation():
    gen = torch.Generator().manual_seed(3)
    q, k, v = inputs(gen, "cpu", nq=300, nk=300, d=128)
    o_cpu = sage_attn.sageattn3(q, k, v, is_causal=True).float()
    o_gpu = sage_attn.sageattn3(q.cuda(), k.cuda(), v.cuda(), is_causal=True).float().cpu()
    rel = (o_gpu - o_cpu).abs().sum() / o_cpu.abs().sum()
    assert rel < 3e-4, rel
