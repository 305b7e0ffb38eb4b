"""The torch front end: sageattn, the SDPA drop-in, the custom op under torch.compile and CUDA
graphs, the stream, errors. GPU tests skip themselves (with the reason) without a CUDA device;
without torch the whole file skips."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import sage_attn  # noqa: E402
from conftest import naive_attention  # noqa: E402

HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with sm_89 or newer")
TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture
def gen(rng):
    g = torch.Generator(device="cpu")
    g.manual_seed(int(rng.integers(2**31)))
    return g


def randn(gen, shape, dtype=torch.float16, device="cuda", bias=0.0):
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if bias:
        x = x + bias * torch.randn((1, shape[1], 1, shape[-1]), generator=gen)
    return x.to(dtype=dtype, device=device)


def metrics(out, ref):
    return sage_attn.metrics(out.detach().float().cpu().numpy(),
                             ref.detach().double().cpu().numpy())


def ref64(q, k, v, causal=None, scale=None, layout="HND"):
    o, lse = naive_attention(q.float().cpu().numpy(), k.float().cpu().numpy(),
                             v.float().cpu().numpy(), layout, causal, scale)
    return torch.from_numpy(o), torch.from_numpy(lse)


# --- CPU tensors: the library's CPU reference through the same custom op ------------------------
def test_cpu_tensors_run_the_reference(gen):
    q, k, v = (randn(gen, (1, 2, 33, 64), torch.float32, "cpu") for _ in range(3))
    o, lse = sage_attn.sageattn(q, k, v, is_causal=True, return_lse=True)
    want = sage_attn.attention_numpy(q.numpy(), k.numpy(), v.numpy(), is_causal=True,
                                     smooth_k=True)
    np.testing.assert_array_equal(o.numpy(), want)
    ref, ref_lse = ref64(q, k, v, "bottom_right")
    assert metrics(o, ref)["cos"] > 0.999
    assert torch.allclose(lse.double(), ref_lse, atol=0.05)


class _OpRecorder(TorchDispatchMode):
    """Records the name of every op dispatched under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _fast_path_checks(q, k, v):
    """Eager calls skip the custom op's dispatch (sage_attn._torch._call); the result must be
    the op's bit for bit, and whatever needs to see the op must still see it."""
    from sage_attn import _lib, _torch as T
    for causal in (False, True):
        o, lse = sage_attn.sageattn(q, k, v, is_causal=causal, return_lse=True)
        mask = _lib.CAUSAL_ALIGNS["bottom_right"] if causal else _lib.MASK_NONE
        # sageattn's defaults: smooth_k True, the others the preset's.
        o_op, lse_op = T._attention_op(q, k, v, _lib.LAYOUT_HND, mask, q.shape[-1] ** -0.5, None,
                                       None, True, None, True, T._RAISE)
        assert torch.equal(o, o_op) and torch.equal(lse, lse_op)
    # A dispatch mode (profilers, flop counters, fake tensors) sees sage_attn::attention.
    with _OpRecorder() as rec:
        sage_attn.sageattn(q, k, v)
    assert any("sage_attn.attention" in op for op in rec.ops), rec.ops
    # And outside any mode nothing is dispatched through the op.
    assert T._dispatch_stack_len() == 0


def test_cpu_eager_fast_path_equals_the_op(gen):
    _fast_path_checks(*(randn(gen, (1, 2, 40, 64), torch.float32, "cpu") for _ in range(3)))


def test_call_fields_are_the_op_schema():
    """_Call names the custom op's arguments: its fields are the op's schema, name by name and in
    order, with the same default for the last; op_args and from_op_args are inverses."""
    from sage_attn import _lib, _torch as T
    schema = torch.ops.sage_attn.attention.default._schema
    assert T._Call._fields == tuple(a.name for a in schema.arguments)
    assert [a.name for a in schema.arguments if a.default_value is not None] == ["family"]
    assert T._Call._field_defaults == {"family": schema.arguments[-1].default_value}
    c = T._Call(*range(len(T._Call._fields)))
    assert T._Call.from_op_args(c.op_args()) == c
    assert T._Call.from_op_args(c.op_args()[:-1]).family == _lib.KERNEL_AUTO


def test_cuda_path_builds_its_struct_from_the_call(gen, monkeypatch):
    """The CUDA path's Python (_run_cuda, _prepare, _plan_of) on CPU tensors with the library's
    plan and run faked: the argument struct holds the call's fields, the plan is made once a
    shape and reused, and the drop-in's plan is the entry its run uses."""
    import contextlib
    from sage_attn import _lib, _torch as T
    planned, ran = [], []

    def fake_plan(a):
        planned.append(bytes(a))
        info = _lib.PlanInfo()
        info.workspace_size, info.has_backward = 96, 1
        return info

    monkeypatch.setattr(_lib, "plan", fake_plan)
    monkeypatch.setattr(_lib, "run", lambda a: ran.append(_lib.AttentionArgs.from_buffer_copy(a)))
    monkeypatch.setattr(T, "_current_stream", lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(T, "_prepared", {})
    q, k, v = (randn(gen, (2, 4, 16, 64), torch.float16, "cpu") for _ in range(3))
    c = T._Call(q, k[:, :2], v[:, :2], _lib.LAYOUT_NHD, _lib.MASK_CAUSAL_TOP_LEFT, 0.5,
                qk_bits=4, smooth_q=None, smooth_k=False, smooth_v=True, return_lse=True,
                fallback=T._RAISE, family=_lib.KERNEL_MMA)
    for _ in range(2):
        o, lse = q.new_empty(q.shape), torch.empty((2, 16, 4))
        T._run_cuda(c, o, lse)
    assert len(planned) == 1 and len(ran) == 2
    a = ran[-1]
    variant, quant = _lib.quant_settings(4, None, False, True)
    assert (a.q, a.k, a.v, a.o, a.lse) == (q.data_ptr(), c.k.data_ptr(), c.v.data_ptr(),
                                           o.data_ptr(), lse.data_ptr())
    assert (a.batch, a.heads_q, a.heads_kv, a.seq_q, a.seq_kv, a.head_dim) == (2, 16, 16, 4, 2, 64)
    assert (a.layout, a.mask, a.scale, a.kernel, a.backend, a.stream, a.workspace_size) == (
        _lib.LAYOUT_NHD, _lib.MASK_CAUSAL_TOP_LEFT, 0.5, _lib.KERNEL_MMA, _lib.BACKEND_CUDA, 1234,
        96)
    assert a.variant == variant and bytes(a.quant) == bytes(quant)
    assert (a.k_strides.batch, a.k_strides.token, a.k_strides.head) == tuple(c.k.stride()[:3])
    # The drop-in's plan: its own entry (preset, no LSE, AUTO), shared with its run.
    q2, k2, v2 = (randn(gen, (1, 2, 8, 64), torch.float16, "cpu") for _ in range(3))
    prep = T._plan_of(q2, k2, v2, _lib.LAYOUT_HND, _lib.MASK_NONE, 0.125)
    assert prep.has_backward and prep.workspace == 96 and len(planned) == 2
    a = _lib.AttentionArgs.from_buffer_copy(planned[-1])
    assert (a.kernel, a.variant, a.lse, a.mask) == (_lib.KERNEL_AUTO, _lib.VARIANT_SAGE2_8B, None,
                                                   _lib.MASK_NONE)
    T._run_cuda(T._dropin_call(q2, k2, v2, _lib.LAYOUT_HND, _lib.MASK_NONE, 0.125,
                               T._FALLBACK_SDPA_ROUTED), q2.new_empty(q2.shape), None)
    assert len(planned) == 2 and len(ran) == 3


def test_cpu_op_path_carries_every_argument(gen, monkeypatch):
    """Through the custom op (inputs that require grad), sageattn hands the library each of its
    arguments by name: what _attention receives is the call sageattn built, with return_lse
    forced on for the backward, and the backward gets the forward's layout, mask, scale and
    kernel family."""
    from sage_attn import _lib, _torch as T
    seen, seen_bwd = [], []
    attention, backward = T._attention, T._backward
    # (The CPU reference refuses a GPU kernel family: recorded, then run as AUTO.)
    monkeypatch.setattr(T, "_attention", lambda c: seen.append(c) or attention(
        c._replace(family=_lib.KERNEL_AUTO)))
    monkeypatch.setattr(T, "_backward", lambda *a: seen_bwd.append(a) or backward(
        *a[:-1], _lib.KERNEL_AUTO))
    q, k, v = (randn(gen, (1, 8, 2, 64), torch.float32, "cpu").requires_grad_()
               for _ in range(3))
    o = sage_attn.sageattn(q, k, v, tensor_layout="NHD", is_causal=True, sm_scale=0.25,
                           qk_bits=4, smooth_k=False, smooth_v=True, causal_align="top_left",
                           kernel="mma")
    (c,) = seen
    assert (c.layout, c.mask, c.scale, c.qk_bits, c.smooth_q, c.smooth_k, c.smooth_v,
            c.return_lse, c.fallback, c.family) == (
        _lib.LAYOUT_NHD, _lib.MASK_CAUSAL_TOP_LEFT, 0.25, 4, None, False, True, True, T._RAISE,
        _lib.KERNEL_MMA)
    assert c.q is not None and c.q.shape == q.shape
    o.sum().backward()
    (args,) = seen_bwd
    assert args[5:] == (_lib.LAYOUT_NHD, _lib.MASK_CAUSAL_TOP_LEFT, 0.25, _lib.KERNEL_MMA)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_unknown_keyword_is_type_error(gen):
    q = randn(gen, (1, 1, 8, 64), torch.float32, "cpu")
    with pytest.raises(TypeError):
        sage_attn.sageattn(q, q, q, smooth_k_typo=True)
    with pytest.raises(TypeError):
        sage_attn.scaled_dot_product_attention(q, q, q, need_weights=False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_vmap_runs_each_slice(gen, device):
    # torch.func.vmap's tensors pass for plain ones but have no storage of their own: the call
    # goes through the op, whose per-slice fallback gives each slice's own call, bit for bit.
    x = randn(gen, (3, 1, 2, 17, 64), torch.float16, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's note that the op has no batching rule)
        got = torch.vmap(lambda t: sage_attn.sageattn(t, t, t, is_causal=True))(x)
    want = torch.stack([sage_attn.sageattn(t, t, t, is_causal=True) for t in x])
    assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("crossover", [True, False])
def test_gpu_dropin_under_vmap_is_each_slices_call(gen, crossover):
    """The SDPA drop-in under torch.func.vmap on CUDA: each slice gets what the drop-in gives
    that slice called alone (torch's SDPA at this short length with the crossover on, sage with
    it off), bit for bit."""
    x = randn(gen, (3, 1, 2, 96, 64))
    sage_attn.set_dropin_crossover(crossover)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # (torch's note that the op has no batching rule)
            got = torch.vmap(lambda t: sage_attn.scaled_dot_product_attention(t, t, t))(x)
            want = torch.stack([sage_attn.scaled_dot_product_attention(t, t, t) for t in x])
            exact = torch.stack([TORCH_SDPA(t, t, t) for t in x])
    finally:
        sage_attn.set_dropin_crossover(True)
    assert torch.equal(got, want)
    assert torch.equal(got, exact) == crossover  # (sage's 8-bit result is not torch's bits)


def test_sdpa_drop_in_on_cpu_falls_back_exactly(gen):
    q, k, v = (randn(gen, (2, 4, 10, 32), torch.float32, "cpu") for _ in range(3))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = sage_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(got, TORCH_SDPA(q, k, v, is_causal=True))


def test_patching_functional_sdpa_does_not_recurse(gen, monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", sage_attn.scaled_dot_product_attention)
    q = randn(gen, (1, 2, 9, 16), torch.float32, "cpu")
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert torch.equal(got, TORCH_SDPA(q, q, q, attn_mask=mask))


@pytest.mark.parametrize("make,exc,words", [
    (lambda q: (q.double(), q.double(), q.double()), TypeError, "dtype"),
    (lambda q: (q, q.half(), q), TypeError, "one dtype"),
    (lambda q: (q[0], q[0], q[0]), ValueError, "4 dimensions"),
    (lambda q: (q, q[:, :, :, :32], q[:, :, :, :32]), ValueError, "head_dim"),
    (lambda q: (q, q, q[:, :, :3]), ValueError, "v: shape"),
    (lambda q: (q, q[:, :3], q[:, :3]), ValueError, "heads_kv"),
    (lambda q: (q.transpose(-1, -2), q, q), ValueError, "contiguous"),
    (lambda q: (np.zeros(3), q, q), TypeError, "q"),
    (lambda q: (q[..., :0], q[..., :0], q[..., :0]), sage_attn.SageArgumentError, "head_dim = 0"),
    (lambda q: (q.to("meta"), q.to("meta"), q.to("meta")), ValueError, "device meta"),
])
def test_bad_input_cpu(gen, make, exc, words):
    q = randn(gen, (1, 4, 64, 64), torch.float32, "cpu")
    with pytest.raises(exc, match=words):
        sage_attn.sageattn(*make(q))


def test_bad_options(gen):
    q = randn(gen, (1, 2, 8, 64), torch.float32, "cpu")
    with pytest.raises(ValueError, match="tensor_layout"):
        sage_attn.sageattn(q, q, q, tensor_layout="BHND")
    with pytest.raises(ValueError, match="qk_bits"):
        sage_attn.sageattn(q, q, q, qk_bits=2)
    with pytest.raises(ValueError, match="causal_align"):
        sage_attn.sageattn(q, q, q, is_causal=True, causal_align="center")
    with pytest.raises(ValueError, match="sm_scale"):
        sage_attn.sageattn(q, q, q, sm_scale=float("nan"))
    with pytest.raises(TypeError, match="smooth_q"):
        sage_attn.sageattn(q, q, q, smooth_q=1)


# --- GPU ---------------------------------------------------------------------------------------
SHAPES = [  # (B, Hq, Hkv, Nq, Nk)
    (1, 2, 2, 1, 1), (2, 2, 2, 17, 17), (1, 4, 1, 128, 128), (1, 4, 4, 1000, 1000),
    (1, 8, 2, 300, 1000), (1, 2, 2, 1000, 77),
]


def call_emulation(q, k, v, causal_align=None, scale=None, kernel=None, return_lse=False,
                   qk_bits=None, return_kernel=False):
    """The CPU emulation of what sageattn(q, k, v, ..., kernel=kernel) runs on the GPU: the plan
    of the same arguments (sage_attention_plan) names the quantization config whose emulation
    computes the call (the kernel's tile, K groups, softmax blocks, accumulator, polynomial 2^x),
    and the CPU reference runs it on host copies of the inputs. q, k, v: CUDA tensors, HND.
    return_kernel: also the plan's kernel (_lib.KERNEL_MMA or KERNEL_SM90), last."""
    from sage_attn import _lib
    kernels = {None: _lib.KERNEL_AUTO, "auto": _lib.KERNEL_AUTO, "mma": _lib.KERNEL_MMA,
               "sm90": _lib.KERNEL_SM90}
    dtype = {torch.float16: _lib.DTYPE_FP16, torch.bfloat16: _lib.DTYPE_BF16}[q.dtype]
    o = torch.empty_like(q)

    def fill(a, tensors):
        # Pointers and strides of the tensors given (the GPU call's, or the host copies', which
        # are contiguous where a view such as an NHD tensor's transpose is not).
        a.q, a.k, a.v, a.o = (t.data_ptr() for t in tensors)
        a.batch, a.heads_q, a.heads_kv = q.shape[0], q.shape[1], k.shape[1]
        a.seq_q, a.seq_kv, a.head_dim = q.shape[2], k.shape[2], q.shape[3]
        a.layout = _lib.LAYOUT_HND
        for field, x in zip(("q_strides", "k_strides", "v_strides", "o_strides"), tensors):
            _lib.set_strides(getattr(a, field), _lib.LAYOUT_HND, list(x.stride()))
        a.dtype = dtype
        a.scale = 0.0 if scale is None else float(scale)
        a.mask = _lib.CAUSAL_ALIGNS[causal_align] if causal_align else _lib.MASK_NONE

    # The GPU call's plan: sageattn's defaults (8-bit unless qk_bits, smooth K, the preset's
    # smooth Q and V).
    a = _lib.new_args()
    fill(a, (q, k, v, o))
    a.variant, a.quant = _lib.quant_settings(qk_bits, None, True, None)
    a.kernel = kernels[kernel]
    info = _lib.plan(a)
    # Its emulation on the host: the same bits (fp16/bf16 copies), the plan's config as CUSTOM.
    host = [t.cpu().contiguous() for t in (q, k, v)]
    out = torch.empty_like(host[0])
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    c = _lib.new_args()
    fill(c, (*host, out))
    c.lse = lse.data_ptr()
    c.variant, c.quant = _lib.VARIANT_CUSTOM, info.emulation
    c.backend = _lib.BACKEND_CPU
    _lib.run(c)
    result = (out, lse) if return_lse else (out,)
    if return_kernel:
        result += (info.kernel,)
    return result if len(result) > 1 else result[0]


IS_SM90 = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)


def sage_attn_plan_head_dim(q, k, v, causal_align, qk_bits):
    """The kernel_head_dim of the plan sageattn's call gets (HND CUDA tensors)."""
    from sage_attn import _lib
    a = _lib.new_args()
    o = torch.empty_like(q)
    a.q, a.k, a.v, a.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    a.batch, a.heads_q, a.heads_kv = q.shape[0], q.shape[1], k.shape[1]
    a.seq_q, a.seq_kv, a.head_dim = q.shape[2], k.shape[2], q.shape[3]
    a.layout = _lib.LAYOUT_HND
    for field, x in (("q_strides", q), ("k_strides", k), ("v_strides", v), ("o_strides", o)):
        _lib.set_strides(getattr(a, field), _lib.LAYOUT_HND, list(x.stride()))
    a.dtype = {torch.float16: _lib.DTYPE_FP16, torch.bfloat16: _lib.DTYPE_BF16}[q.dtype]
    a.mask = _lib.CAUSAL_ALIGNS[causal_align] if causal_align else _lib.MASK_NONE
    a.variant, a.quant = _lib.quant_settings(qk_bits, None, True, None)
    return _lib.plan(a).kernel_head_dim


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
def test_gpu_matches_emulation_and_float64(gen, d, shape, causal):
    B, Hq, Hkv, Nq, Nk = shape
    q, k, v = randn(gen, (B, Hq, Nq, d)), randn(gen, (B, Hkv, Nk, d)), randn(gen, (B, Hkv, Nk, d))
    o, lse = sage_attn.sageattn(q, k, v, is_causal=causal is not None,
                                causal_align=causal or "bottom_right", return_lse=True,
                                kernel="mma")
    torch.cuda.synchronize()
    emu, emu_lse = call_emulation(q, k, v, causal, kernel="mma", return_lse=True)
    emu, emu_lse = emu.numpy(), emu_lse.numpy()
    # Same arithmetic up to the kernel's exp2 approximation (a few ulp of fp32) moving an FP8
    # rounding of P now and then: the outputs agree to well below one fp16 ulp on average.
    m = metrics(o, torch.from_numpy(emu.astype(np.float64)))
    assert m["rel_l1"] < 2e-3 and m["cos"] > 0.99999, m
    ref, ref_lse = ref64(q, k, v, causal)
    assert metrics(o, ref)["cos"] > 0.999
    live = torch.isfinite(ref_lse)
    # Against float64 the LSE carries the INT8 error of the scores (a row with one key: one
    # score's error, a few 1e-2); against the emulation it is fp32 rounding.
    err = (lse.cpu().double()[live] - ref_lse[live]).abs()
    assert err.max() < 0.1 and err.mean() < 0.01, (err.max(), err.mean())
    assert torch.allclose(lse.cpu()[live], torch.from_numpy(emu_lse)[live], atol=1e-3)


@gpu
@pytest.mark.parametrize("d", [8, 24, 32, 40, 48, 72, 80, 96, 112, 136, 144, 192, 200, 240, 248])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_gpu_padded_head_dims(gen, d, causal, dropin_always_sage):
    """Head dims that are multiples of 8 run at the native 64, 128 or 256 with zero channels
    (the plan's kernel_head_dim): against the emulation at the caller's head dim as tight as the
    native ones, against float64 as accurate; and the SDPA drop-in runs them (which head dims
    have a kernel is the library's answer, not a list here)."""
    q, k, v = randn(gen, (1, 4, 300, d)), randn(gen, (1, 2, 777, d), bias=2.0), \
        randn(gen, (1, 2, 777, d))
    o = sage_attn.sageattn(q, k, v, is_causal=causal is not None,
                           causal_align=causal or "bottom_right")
    assert o.shape == q.shape
    emu = call_emulation(q, k, v, causal)
    m = metrics(o, emu.double())
    assert m["rel_l1"] < 2e-3 and m["cos"] > 0.99999, m
    ref, _ = ref64(q, k, v, causal)
    assert metrics(o, ref)["cos"] > 0.999
    qs, ks, vs = q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    assert sage_attn.dropin_backend(qs, ks, vs, is_causal=causal is not None) == "sage"
    with torch.no_grad():
        got = sage_attn.scaled_dot_product_attention(qs, ks, vs, is_causal=causal is not None)
    want = TORCH_SDPA(qs, ks, vs, is_causal=causal is not None)
    m = metrics(got, want.double())
    assert m["cos"] > 0.999 and m["rel_l1"] < 0.06, m


@gpu
@pytest.mark.parametrize("d", [40, 72])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qk_bits", [8, 4])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_gpu_sd_and_dit_head_dims(gen, d, dtype, qk_bits, layout, causal):
    """D = 40 (Stable Diffusion 1.x's UNet) and 72 (DiT-XL/2, PixArt-α/Σ: hidden 1152 over 16
    heads), multiples of 8 but not of 16, run on the GPU (the D = 64 and 128 kernels, zero
    channels past D): as tight against the emulation of the plan's config as the native head
    dims, as accurate against float64 (8-bit cos > 0.999; 4-bit on N(0,1) queries ~0.98, as at
    D = 64/128), the LSE too; both layouts, GQA, lengths off the blocks, 8- and 4-bit, fp16 and
    bf16, causal or not; the plan says which kernel head dim runs them."""
    b, hq, hkv, nq, nk = 2, 4, 2, 333, 1000
    # The same inputs in either layout (randn's bias is per head and channel in HND), NHD as a
    # contiguous [B, N, H, D] tensor.
    lay = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(1, 2).contiguous())
    q = lay(randn(gen, (b, hq, nq, d), dtype, bias=0.5))
    k, v = (lay(randn(gen, (b, hkv, nk, d), dtype, bias=2.0)),
            lay(randn(gen, (b, hkv, nk, d), dtype)))
    o, lse = sage_attn.sageattn(q, k, v, tensor_layout=layout, is_causal=causal is not None,
                                return_lse=True, qk_bits=qk_bits)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (b, hq, nq)
    assert torch.isfinite(o).all()
    hnd = [x if layout == "HND" else x.transpose(1, 2) for x in (q, k, v, o)]
    assert sage_attn_plan_head_dim(*hnd[:3], causal, qk_bits) == (64 if d == 40 else 128)
    emu = call_emulation(*hnd[:3], causal, qk_bits=qk_bits)
    m = metrics(hnd[3], emu.double())
    assert m["rel_l1"] < (2e-3 if dtype == torch.float16 else 4e-3) and m["cos"] > 0.99999, m
    ref, ref_lse = ref64(q, k, v, causal, None, layout)
    m = metrics(o, ref)
    if qk_bits == 8:
        assert m["cos"] > 0.999 and m["rel_l1"] < 0.06, m
    else:
        assert m["cos"] > 0.97, m
    live = torch.isfinite(ref_lse)
    err = (lse.cpu().double()[live] - ref_lse[live]).abs()
    if qk_bits == 8:
        assert err.max() < 0.1, err.max()
    else:
        # A row whose softmax is nearly one key (a rare row on these inputs) has that key's
        # score for its LSE, and so the whole INT4 error of one score, now and then past 0.3 on
        # fresh seeds; other rows average many keys' errors. The mean holds the LSE's accuracy
        # (one 128-row tile's LSE off by 0.2 moves it past the bound), the max catches a broken row.
        assert err.max() < 0.75 and err.mean() < 0.03, (err.max(), err.mean())


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qk_bits", [8, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dim_256(gen, dtype, qk_bits, causal, dropin_always_sage):
    """D = 256 runs natively on the GPU (on sm_90 the 8-bit calls run the wgmma kernel, 4-bit the
    mma.sync one): NHD and HND, GQA, N off the blocks, as accurate against float64 as D = 128
    (8-bit cos > 0.999; 4-bit on these channel-biased inputs too), the emulation's config
    reproduced; the plan says kernel_head_dim 256; on sm_90 the mma.sync kernel forced at 8-bit
    matches its own emulation, and forcing the sm90 kernel at 4-bit is a ValueError; the drop-in
    runs it."""
    q = randn(gen, (2, 4, 333, 256), dtype, bias=0.5)
    k, v = randn(gen, (2, 2, 1000, 256), dtype, bias=2.0), randn(gen, (2, 2, 1000, 256), dtype)
    o = sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=qk_bits)
    assert o.shape == q.shape and o.dtype == dtype and torch.isfinite(o).all()
    align = "bottom_right" if causal else None
    assert sage_attn_plan_head_dim(q, k, v, align, qk_bits) == 256
    # The emulation of the plan's config, as tight as at D = 64/128 (one output ulp on average).
    emu = call_emulation(q, k, v, align, qk_bits=qk_bits)
    m = metrics(o, emu.double())
    assert m["rel_l1"] < (2e-3 if dtype == torch.float16 else 4e-3) and m["cos"] > 0.99999, m
    ref, _ = ref64(q, k, v, align)
    m = metrics(o, ref)
    if qk_bits == 8:
        assert m["cos"] > 0.999 and m["rel_l1"] < 0.06, m
    else:  # (4-bit on N(0,1) queries: cos ~0.98, as at D = 64/128)
        assert m["cos"] > 0.97, m
    # NHD gives the same bits as HND.
    o_nhd = sage_attn.sageattn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               tensor_layout="NHD", is_causal=causal, qk_bits=qk_bits)
    assert torch.equal(o_nhd.transpose(1, 2), o)
    if IS_SM90 and qk_bits == 4:
        with pytest.raises(ValueError, match="head_dim"):
            sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=4, kernel="sm90")
    elif IS_SM90:
        o_mma = sage_attn.sageattn(q, k, v, is_causal=causal, qk_bits=qk_bits, kernel="mma")
        emu_mma = call_emulation(q, k, v, align, qk_bits=qk_bits, kernel="mma")
        m = metrics(o_mma, emu_mma.double())
        assert m["rel_l1"] < (2e-3 if dtype == torch.float16 else 4e-3), m
    if qk_bits == 8:
        kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        assert sage_attn.dropin_backend(q, kr, vr, is_causal=causal) == "sage"
        with torch.no_grad():
            got = sage_attn.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
        assert metrics(got, TORCH_SDPA(q, kr, vr, is_causal=causal).double())["cos"] > 0.999


@gpu
@pytest.mark.parametrize("d", [80, 64])
def test_gpu_dropin_training_needs_the_library_backward(gen, d, dropin_always_sage):
    """With the crossover off the drop-in trains with sage where the library has the backward
    (its plan's has_backward: D 64 and 128) and hands a padded head dim's training call to
    torch's SDPA (one warning), whose gradients it then gives; inference at that D runs sage."""
    q, k, v = (randn(gen, (1, 2, 200, d)).requires_grad_() for _ in range(3))
    with torch.no_grad():
        assert sage_attn.dropin_backend(q, k, v, is_causal=True) == "sage"
    assert sage_attn.dropin_backend(q, k, v, is_causal=True) == ("sage" if d == 64 else "sdpa")
    g = randn(gen, (1, 2, 200, d))
    want = torch.autograd.grad(TORCH_SDPA(q, k, v, is_causal=True), (q, k, v), g)
    sage_attn._torch._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sage_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = torch.autograd.grad(out, (q, k, v), g)
    backward_warnings = [w for w in caught if "no backward kernel" in str(w.message)]
    assert len(backward_warnings) == (0 if d == 64 else 1), [str(w.message) for w in caught]
    for x, y in zip(got, want):  # (SDPA's backward may sum dQ in any order: not bitwise)
        assert metrics(x, y.double())["cos"] > (0.99 if d == 64 else 0.99999)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_dtypes_layouts_strides(gen, dtype, layout):
    base = randn(gen, (2, 6, 258, 128), dtype)  # HND storage; views below are strided
    q, k, v = base[:, :4], base[:, 4:5, ::2], base[:, 5:6, 1::2]
    ref, _ = ref64(q, k, v, "bottom_right")
    if layout == "NHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    o = sage_attn.sageattn(q, k, v, tensor_layout=layout, is_causal=True)
    assert o.dtype == dtype and o.shape == q.shape
    if layout == "NHD":
        o = o.transpose(1, 2)
    m = metrics(o, ref)
    assert m["cos"] > 0.999 and m["rel_l1"] < 0.06, m
    o2 = sage_attn.sageattn(*(x.contiguous() for x in (q, k, v)), tensor_layout=layout,
                            is_causal=True)
    assert torch.equal(o2.transpose(1, 2) if layout == "NHD" else o2, o)


@gpu
def test_gpu_4bit_and_smoothing(gen):
    q = randn(gen, (1, 4, 1024, 128), bias=4.0)
    k = randn(gen, (1, 4, 1024, 128), bias=8.0)
    v = randn(gen, (1, 4, 1024, 128), bias=8.0)
    ref, _ = ref64(q, k, v)
    m4 = metrics(sage_attn.sageattn(q, k, v, qk_bits=4), ref)
    assert m4["cos"] > 0.995, m4
    m8 = metrics(sage_attn.sageattn(q, k, v), ref)
    assert m8["rel_l1"] < 0.0115, m8
    m8_raw = metrics(sage_attn.sageattn(q, k, v, smooth_v=False), ref)
    assert m8["rel_l1"] < m8_raw["rel_l1"]


@gpu
def test_gpu_deterministic_inputs_untouched_output_poison(gen):
    q, k, v = (randn(gen, (2, 4, 700, 64)) for _ in range(3))
    saved = [x.clone() for x in (q, k, v)]
    first = sage_attn.sageattn(q, k, v, is_causal=True)
    for _ in range(3):
        # Leave a NaN-filled block of the output's size in the caching allocator for the op.
        poison = torch.full_like(q, float("nan"))
        del poison
        again = sage_attn.sageattn(q, k, v, is_causal=True)
        assert torch.equal(again, first)
    assert not torch.isnan(first).any()
    for x, s in zip((q, k, v), saved):
        assert torch.equal(x, s)


@gpu
def test_gpu_eager_fast_path_equals_the_op(gen):
    _fast_path_checks(*(randn(gen, (2, 4, 300, 128)) for _ in range(3)))


@gpu
def test_gpu_uses_current_stream(gen):
    q, k, v = (randn(gen, (1, 4, 512, 128)) for _ in range(3))
    q2 = randn(gen, (1, 4, 512, 128))
    want = sage_attn.sageattn(q2, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy: the copy below lands late
        q.copy_(q2)
        got = sage_attn.sageattn(q, k, v)  # on the default stream it would read the old q
    side.synchronize()
    assert torch.equal(got, want)


@gpu
def test_gpu_cuda_graph_replay_equals_eager(gen):
    q, k, v = (randn(gen, (2, 8, 1000, 128)) for _ in range(3))
    static = [x.clone() for x in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        sage_attn.sageattn(*static, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sage_attn.sageattn(*static, is_causal=True)
    for _ in range(2):
        fresh = [randn(gen, x.shape) for x in static]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sage_attn.sageattn(*fresh, is_causal=True))


class _Block(torch.nn.Module):
    def __init__(self, use_sdpa):
        super().__init__()
        self.proj = torch.nn.Linear(128, 128, dtype=torch.float16, device="cuda")
        self.use_sdpa = use_sdpa

    def forward(self, x):  # x [B, H, N, 128]
        q = self.proj(x)
        if self.use_sdpa:
            return F.scaled_dot_product_attention(q, x, x, is_causal=True)
        return sage_attn.sageattn(q, x, x, is_causal=True, qk_bits=8)


@pytest.fixture
def dropin_always_sage():
    """The SDPA drop-in runs sage on every shape it can (its crossover table set aside), so
    that small test shapes exercise the library."""
    sage_attn.set_dropin_crossover(False)
    yield
    sage_attn.set_dropin_crossover(True)


@gpu
@pytest.mark.parametrize("use_sdpa", [False, True])
def test_gpu_torch_compile_fullgraph(gen, monkeypatch, use_sdpa, dropin_always_sage):
    torch._dynamo.reset()
    monkeypatch.setattr(F, "scaled_dot_product_attention", sage_attn.scaled_dot_product_attention)
    block = _Block(use_sdpa)
    x = randn(gen, (2, 4, 333, 128))
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True)
        got = compiled(x)
    m = metrics(got, eager.double())
    assert m["rel_l1"] < 1e-3, m  # the projection may be fused differently: not always bitwise


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk", [(1000, 1000), (300, 1000), (1, 517), (128, 128)])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_gpu_sdpa_semantics(gen, d, nq, nk, hkv, dropin_always_sage):
    q, k, v = randn(gen, (2, 4, nq, d)), randn(gen, (2, hkv, nk, d)), randn(gen, (2, hkv, nk, d))
    gqa = hkv == 2  # one key head (hkv 1) is plain broadcasting in SDPA, no enable_gqa needed
    with torch.no_grad():
        for causal in (False, True):
            for scale in (None, 0.05):
                got = sage_attn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             scale=scale, enable_gqa=gqa)
                want = TORCH_SDPA(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
                m = metrics(got, want.double())
                assert m["cos"] > 0.999 and m["rel_l1"] < 0.06, (causal, scale, m)
    if gqa:  # SDPA rejects 4 query heads on 2 key heads without enable_gqa; so does the drop-in
        with pytest.raises(RuntimeError):
            TORCH_SDPA(q, k, v)
        with pytest.raises(RuntimeError):
            sage_attn.scaled_dot_product_attention(q, k, v)


@gpu
def test_gpu_dropin_crossover(gen):
    """The drop-in asks the library's plan whether torch's SDPA is faster for a shape: what it
    reports (dropin_backend) is what it runs, bit for bit torch's output where it hands over."""
    short = [randn(gen, (1, 2, 256, 128)) for _ in range(3)]
    long_ = [randn(gen, (1, 16, 16384, 128)) for _ in range(3)]  # measured 1.12-1.14x on an H100
    cc = torch.cuda.get_device_capability()
    with torch.no_grad():
        for q, k, v in (short, long_):
            for causal in (False, True):
                choice = sage_attn.dropin_backend(q, k, v, is_causal=causal)
                assert choice in ("sage", "sdpa")
                got = sage_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
                want = TORCH_SDPA(q, k, v, is_causal=causal)
                if choice == "sdpa":
                    assert torch.equal(got, want)
                else:
                    m = metrics(got, want.double())
                    assert m["cos"] > 0.999 and not torch.equal(got, want), m
        if cc == (9, 0):  # the model's measured architecture: short shapes go to torch
            assert sage_attn.dropin_backend(*short) == "sdpa"
            assert sage_attn.dropin_backend(*long_) == "sage"
        sage_attn.set_dropin_crossover(False)
        try:
            assert sage_attn.dropin_backend(*short) == "sage"
            got = sage_attn.scaled_dot_product_attention(*short)
            assert not torch.equal(got, TORCH_SDPA(*short))
        finally:
            sage_attn.set_dropin_crossover(True)
        with pytest.raises(TypeError):
            sage_attn.set_dropin_crossover(1)


@gpu
@pytest.mark.parametrize("case", ["mask", "dropout", "head_dim", "fp32", "3d"])
def test_gpu_sdpa_fallbacks_warn_once_and_match_torch(gen, case):
    q, k, v = (randn(gen, (1, 2, 64, 64)) for _ in range(3))
    kw = {}
    if case == "mask":
        kw["attn_mask"] = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    elif case == "head_dim":
        q, k, v = (x[..., :36].contiguous() for x in (q, k, v))  # not a multiple of 8
    elif case == "fp32":
        q, k, v = (x.float() for x in (q, k, v))
    elif case == "3d":
        q, k, v = (x[0] for x in (q, k, v))
    sage_attn._torch._warned.clear()
    with pytest.warns(UserWarning, match="sage_attn"):
        if case == "dropout":
            torch.manual_seed(0)
            got = sage_attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
            torch.manual_seed(0)
            want = TORCH_SDPA(q, k, v, dropout_p=0.5)
        else:
            got = sage_attn.scaled_dot_product_attention(q, k, v, **kw)
            want = TORCH_SDPA(q, k, v, **kw)
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call of the same kind stays quiet
        sage_attn.scaled_dot_product_attention(q, k, v, **kw)


@gpu
@pytest.mark.parametrize("make,exc,words", [
    (lambda q: (q.float(), q.float(), q.float()), TypeError, "dtype"),
    (lambda q: (q[..., :76].contiguous(),) * 3, ValueError, "head_dim"),
    (lambda q: (q, q[:, :3], q[:, :3]), ValueError, "heads_kv"),
    (lambda q: (q, q.cpu(), q.cpu()), ValueError, "device"),
    (lambda q: (q.transpose(-1, -2), q, q), ValueError, "contiguous"),
])
def test_gpu_bad_input(gen, make, exc, words):
    q = randn(gen, (1, 4, 128, 128))
    with pytest.raises(exc, match=words):
        sage_attn.sageattn(*make(q))


@gpu
def test_gpu_accuracy_tool_on_pt_files(gen, tmp_path, capsys):
    import json

    from sage_attn import accuracy
    q, k, v = randn(gen, (1, 300, 2, 128)), randn(gen, (1, 500, 2, 128), bias=4.0), \
        randn(gen, (1, 500, 2, 128))
    for name, x in (("q", q), ("k", k), ("v", v)):
        torch.save(x.cpu(), tmp_path / f"{name}.pt")
    assert accuracy.main(["--q", str(tmp_path / "q.pt"), "--k", str(tmp_path / "k.pt"), "--v",
                          str(tmp_path / "v.pt"), "--layout", "NHD", "--causal",
                          "--causal-align", "top_left", "--json"]) == 0
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)
            if r["table"] == accuracy.TABLE_SAGE}  # the FP4 table has its own SageAttn2-8b row
    ref, _ = ref64(q, k, v, "top_left", layout="NHD")
    want = metrics(sage_attn.sageattn(q, k, v, tensor_layout="NHD", is_causal=True,
                                      causal_align="top_left"), ref)
    assert abs(rows["SageAttn2-8b"]["rel_l1"] - want["rel_l1"]) < 1e-6
    assert rows["SDPA fp16"]["rel_l1"] < 0.01 and rows["SageAttn2-8b"]["cos"] > 0.999


@pytest.mark.skipif(not IS_SM90, reason="needs an sm_90 GPU (the wgmma kernel)")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_sm90_against_its_emulation(gen, d, causal):
    """The wgmma kernel against the emulation its plan names (128-key softmax blocks over 64-key
    K groups, the aligned 13-bit wgmma accumulator, the polynomial 2^x at D = 128): peaked
    (sm_scale 1: few keys carry P~) and flat (default scale: the accumulator's hard case). Both
    quantize identically; ex2.approx (~2^-22) flips a rare E4M3 tie of P^ and the output rounds
    to fp16: rel-L1 within 5e-4 (the C++ sweep's bound, tests/gpu/test_attention_gpu.cu). Its
    accuracy against float64 stays that of the mma kernel (docs/fp8-accumulator.md)."""
    q, k, v = (randn(gen, (2, 4, 700, d)) for _ in range(3))
    align = "bottom_right" if causal else None
    out = {}
    for scale in (1.0, None):
        for kern in ("sm90", "mma"):
            out[kern, scale] = sage_attn.sageattn(q, k, v, is_causal=causal, sm_scale=scale,
                                                  kernel=kern)
        emu = call_emulation(q, k, v, align, scale, kernel="sm90")
        m = metrics(out["sm90", scale], emu.double())
        assert m["rel_l1"] < 5e-4, (scale, m)
    ref, _ = ref64(q, k, v, align)
    e90, emma = metrics(out["sm90", None], ref), metrics(out["mma", None], ref)
    assert e90["rel_l1"] < 1.03 * emma["rel_l1"] + 1e-4, (e90, emma)
