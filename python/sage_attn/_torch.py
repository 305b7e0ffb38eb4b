"""torch front end: `sageattn` and the SDPA drop-in, over one opaque custom op.

`sage_attn::attention` is a torch.library custom op with a fake (meta) implementation, so
torch.compile(fullgraph=True) sees one node and no graph break. The real implementation runs on
the current CUDA stream of the tensors' device, takes its output, LSE and workspace from torch's
allocator (so CUDA-graph capture works: no host sync, no cudaMalloc in the library), and calls
the C API through ctypes. CPU tensors run the library's CPU reference.

Eager calls on plain tensors skip the op's dispatch and run the implementation directly
(_attention): the dispatcher's host time a call can exceed the GPU work of a small call
(tools/probes/host_overhead.py measures a call's host time). Anything that must see the op
(torch.compile, autograd, tensor subclasses, dispatch or function modes) still goes through it.

One C call a call: the library's plan of a shape (workspace size, the crossover hint of the SDPA
drop-in) and the argument struct with everything but the pointers are kept per shape
(_prepared), so a repeated shape costs a struct copy, the output and workspace allocations and
sage_attention() itself, which validates and plans once. The SDPA drop-in keeps its whole answer
(its argument checks, torch's SDPA or sage, and sage's plan) per call signature (_routes), so a
repeated call adds one lookup to what it runs; an eager call on plain tensors that sage runs is
launched by the drop-in itself (_Route.direct: what _call, _attention and _run_cuda would do, less
what its route knows already).
"""
from __future__ import annotations

import ctypes
import math
from typing import NamedTuple, Optional
import warnings

import torch
import torch.nn.functional as F

from . import _fastpath, _lib

# The real SDPA, saved before anyone replaces F.scaled_dot_product_attention with ours.
_torch_sdpa = F.scaled_dot_product_attention
if getattr(_torch_sdpa, "__module__", "").startswith("sage_attn"):
    _torch_sdpa = torch._C._nn.scaled_dot_product_attention
# torch's own SDPA binding (torch.nn.functional's name for it), whose op the C++ fast path calls.
_TORCH_SDPA_OP = torch._C._nn.scaled_dot_product_attention

_GPU_DTYPES = (torch.float16, torch.bfloat16)
_Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled
_AttentionArgs = _lib.AttentionArgs

# The C++ fast path (sage_attn._fastpath; None where it is not built for this torch): repeated
# drop-in and sageattn calls whose route or plan the Python path decided and handed to it
# (_fast_keep, sageattn) are answered there without Python's checks, reads, hash and lookup.
_fast = _fastpath.load()
_fast_ready = False  # configured with the library's struct offsets and entry point


def _fast_configure():
    global _fast_ready
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return False
    A = _AttentionArgs
    offsets = (A.q.offset, A.k.offset, A.v.offset, A.o.offset, A.stream.offset,
               A.workspace.offset, ctypes.sizeof(A))
    run = ctypes.cast(_lib.library().sage_attention, ctypes.c_void_p).value
    _fast.configure(offsets, run, raw)
    _fast_ready = True
    return True


_DTYPE_CODES = {torch.float16: _lib.DTYPE_FP16, torch.bfloat16: _lib.DTYPE_BF16,
                torch.float32: _lib.DTYPE_FP32}
# The op's fallback argument: what to do when the library has no kernel for valid arguments
# (raise, or torch's SDPA for the drop-in), and whether the drop-in's crossover is still to be
# asked (_FALLBACK_SDPA: inside the op, as under torch.compile) or was asked already (eager).
_RAISE, _FALLBACK_SDPA, _FALLBACK_SDPA_ROUTED = 0, 1, 2
KERNELS = {None: _lib.KERNEL_AUTO, "auto": _lib.KERNEL_AUTO, "mma": _lib.KERNEL_MMA,
           "sm90": _lib.KERNEL_SM90}


class _Call(NamedTuple):
    """One forward call's arguments, by name: the one place that knows the order of the custom
    op's arguments (the fields are its schema, in order; tests/python/test_torch_api.py holds
    them equal). Everything else reads fields: `call.return_lse`, never a position."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: int  # _lib.LAYOUT_*
    mask: int  # _lib.MASK_*
    scale: float
    qk_bits: Optional[int]  # 8, 4, None (8) or _lib.QK_BITS_FP4 (sageattn3)
    smooth_q: Optional[bool]  # None: what the preset does
    smooth_k: Optional[bool]
    smooth_v: Optional[bool]
    return_lse: bool
    fallback: int  # _RAISE, _FALLBACK_SDPA or _FALLBACK_SDPA_ROUTED
    family: int = _lib.KERNEL_AUTO  # sage_attention_args.kernel

    def op_args(self) -> tuple:
        """The positional arguments of _attention_op (torch custom ops take tensors and
        scalars, not a structure)."""
        return tuple(self)

    @classmethod
    def from_op_args(cls, args) -> "_Call":
        """The call of _attention_op's arguments (its setup_context's inputs)."""
        return cls(*args)


def _build_args(c: _Call, o, lse):
    q, k, layout = c.q, c.k, c.layout
    hi, ni = (1, 2) if layout == _lib.LAYOUT_HND else (2, 1)
    a = _lib.new_args()
    a.q, a.k, a.v, a.o = q.data_ptr(), k.data_ptr(), c.v.data_ptr(), o.data_ptr()
    a.lse = lse.data_ptr() if lse is not None else None
    a.batch, a.heads_q, a.heads_kv = q.shape[0], q.shape[hi], k.shape[hi]
    a.seq_q, a.seq_kv, a.head_dim = q.shape[ni], k.shape[ni], q.shape[3]
    a.layout = layout
    for field, x in (("q_strides", q), ("k_strides", k), ("v_strides", c.v), ("o_strides", o)):
        _lib.set_strides(getattr(a, field), layout, list(x.stride()))
    a.dtype = _DTYPE_CODES[q.dtype]
    a.scale = c.scale
    a.mask = c.mask
    a.variant, a.quant = _lib.quant_settings(c.qk_bits, c.smooth_q, c.smooth_k, c.smooth_v)
    a.kernel = c.family
    return a


class _Prepared:
    """A CUDA call's shape, planned once: the argument struct without its pointers, the
    workspace size, whether the library's crossover model prefers torch's SDPA, and whether the
    library has the call's backward. workspace_alloc: the workspace's allocation, in elements of
    the query's dtype (itemsize bytes; never none): the run allocates it in that dtype, so that
    torch has no dtype argument to parse."""
    __slots__ = ("args", "workspace", "workspace_alloc", "prefer_sdpa", "prefer_sdpa_training",
                 "has_backward", "sdpa_below")

    def __init__(self, args, info, itemsize):
        args.workspace_size = info.workspace_size
        self.args = bytes(args)
        self.workspace = info.workspace_size
        self.workspace_alloc = max(-(-info.workspace_size // itemsize), 1)
        self.prefer_sdpa = bool(info.prefer_sdpa)
        self.prefer_sdpa_training = bool(info.prefer_sdpa_training)
        self.has_backward = bool(info.has_backward)
        self.sdpa_below = int(info.sdpa_below)


class _Unsupported:
    """A CUDA call's shape the library has no kernel for (kept, so each call need not ask)."""
    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


_prepared: dict = {}
_PREPARED_MAX = 512  # shapes kept (a model has a handful; a sweep may have many)


def _key(c: _Call):
    # Everything the plan and the argument struct depend on except the pointers (the output is
    # allocated contiguous in q's shape, the LSE contiguous), and whether q starts 16-byte
    # aligned: on sm_90 such a Q is quantized inside the kernel, and the workspace then holds no
    # quantized Q. (Not the fallback: it acts around the library call, not in it.)
    q, k, v = c.q, c.k, c.v
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, c.layout, c.mask, c.scale, c.qk_bits,
            c.smooth_q, c.smooth_k, c.smooth_v, c.return_lse, c.family, q.data_ptr() % 16 == 0)


def _prepare(key, c: _Call, o, lse, stream):
    """The plan of a new CUDA shape (validated by the library: a bad shape raises here)."""
    a = _build_args(c, o, lse)
    a.backend = _lib.BACKEND_CUDA
    a.stream = stream
    try:
        prep = _Prepared(a, _lib.plan(a), c.q.element_size())
    except _lib.SageUnsupportedError as e:
        prep = _Unsupported(e)
    if len(_prepared) >= _PREPARED_MAX:
        _prepared.clear()
    _prepared[key] = prep
    return prep


def _planned(prep):
    if type(prep) is _Unsupported:
        raise prep.error
    return prep


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device):
    # The raw stream handle without building a torch.cuda.Stream object (a few us a call).
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


_warned: set = set()


def _warn_once(reason: str):
    # Under torch.compile the fallback is traced into the graph without the warning (dynamo
    # cannot trace warnings); eager calls warn once per reason.
    if torch.compiler.is_compiling() or reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(f"sage_attn: {reason}; using torch.nn.functional.scaled_dot_product_attention",
                  stacklevel=3)


def _attention(c: _Call, prep=None):
    """The op's implementation (see the module docstring): (o, lse), lse None unless asked.
    prep: the call's _Prepared where the caller has it already (the drop-in's route), else it is
    looked up here."""
    q, k, v, layout, mask, scale = c.q, c.k, c.v, c.layout, c.mask, c.scale
    if (c.fallback == _FALLBACK_SDPA and q.is_cuda and
            _dropin_prefers_sdpa(q, k, v, mask, scale, training=c.return_lse)):
        # The SDPA drop-in (top-left causal, HND, no LSE unless training: _call) on a shape where
        # torch's SDPA is faster on this GPU, or a training call whose backward the library does
        # not have: decided here, inside the op, so that compiled graphs decide alike.
        return _torch_sdpa(q, k, v, is_causal=mask != _lib.MASK_NONE, scale=scale,
                           enable_gqa=q.shape[1] != k.shape[1]), None
    # (new_empty with the sizes as separate ints: torch parses a torch.Size argument, or a
    # tuple, at about twice the host time.)
    o = q.new_empty(*q.shape)
    lse = None
    if c.return_lse:
        hi, ni = (1, 2) if layout == _lib.LAYOUT_HND else (2, 1)
        lse = q.new_empty((q.shape[0], q.shape[hi], q.shape[ni]), dtype=torch.float32)
    try:
        if q.is_cuda:
            _on_device(q.device, _run_cuda, c, o, lse, prep)
        else:
            if q.device.type != "cpu":  # (a meta or other device's tensor has no host data)
                raise ValueError(f"q: device {q.device} is not supported; pass CUDA or CPU "
                                 "tensors")
            a = _build_args(c, o, lse)
            a.backend = _lib.BACKEND_CPU
            _lib.run(a)
    except _lib.SageUnsupportedError as e:
        if c.fallback == _RAISE:
            raise
        _sdpa_into(o, q, k, v, mask, scale, e)
        lse = None  # (no LSE from SDPA: a backward then takes SDPA's gradient)
    return o, lse


def _on_device(device, fn, *args):
    """fn(*args) with `device` the current CUDA device (switched only where it is not)."""
    if device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return fn(*args)
    return fn(*args)


def _sdpa_into(o, q, k, v, mask, scale, error):
    # Only reached from the SDPA drop-in, which asks for top-left causal in HND, no LSE.
    _warn_once(f"no kernel for this call ({error})")
    o.copy_(_torch_sdpa(q, k, v, is_causal=mask != _lib.MASK_NONE, scale=scale,
                        enable_gqa=q.shape[1] != k.shape[1]))


def _run_cuda(c: _Call, o, lse, prep=None):
    q = c.q
    device = q.device
    if prep is None:
        key = _key(c)
        prep = _prepared.get(key)
        if prep is None:
            prep = _prepare(key, c, o, lse, _current_stream(device))
        prep = _planned(prep)
    _launch(q, c.k, c.v, o, lse, prep, device)


def _launch(q, k, v, o, lse, prep, device):
    """The library's run of a planned CUDA call: the plan's struct with this call's pointers and
    stream, a workspace from torch's allocator."""
    a = _AttentionArgs.from_buffer_copy(prep.args)  # (workspace_size is the plan's already)
    a.q, a.k, a.v, a.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    if lse is not None:  # (else None already: the plan's struct has the LSE of its return_lse)
        a.lse = lse.data_ptr()
    a.stream = _current_stream(device)
    # (An int size in q's dtype, not a tuple or a dtype: the least argument parsing. The tensor
    # lives until the launch is queued; freed after, its memory goes only to work queued after it
    # on this stream.)
    ws = q.new_empty(prep.workspace_alloc)
    a.workspace = ws.data_ptr()
    _lib.run(a)


def _plan_of(q, k, v, layout, mask, scale):
    """The cached plan of the SDPA drop-in's CUDA call (the preset, no LSE, the library's kernel):
    the same entry its run uses."""
    c = _dropin_call(q, k, v, layout, mask, scale, _FALLBACK_SDPA_ROUTED)
    key = _key(c)
    prep = _prepared.get(key)
    if prep is None:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        with torch.cuda.device(q.device):
            prep = _prepare(key, c, o, None, _current_stream(q.device))
    return _planned(prep)


@torch.library.custom_op("sage_attn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: int, mask: int,
                  scale: float, qk_bits: Optional[int], smooth_q: Optional[bool],
                  smooth_k: Optional[bool], smooth_v: Optional[bool], return_lse: bool,
                  fallback: int, family: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # (family: the kernel family, sage_attention_args.kernel; an op argument named "kernel"
    # collides with Inductor's FallbackKernel.create.)
    o, lse = _attention(_Call(q, k, v, layout, mask, scale, qk_bits, smooth_q, smooth_k, smooth_v,
                              return_lse, fallback, family))
    if lse is None:  # an op returns tensors
        lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    return o, lse


@_attention_op.register_fake
def _(q, k, v, layout, mask, scale, qk_bits, smooth_q, smooth_k, smooth_v, return_lse, fallback,
      family=0):
    hi, ni = (1, 2) if layout == _lib.LAYOUT_HND else (2, 1)
    lse_shape = (q.shape[0], q.shape[hi], q.shape[ni]) if return_lse else (0,)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=torch.float32, device=q.device))


def _lse_strides(field, x):
    field.batch, field.head, field.token = x.stride(0), x.stride(1), x.stride(2)


SageBwdFallbackWarning = _lib.SageBwdFallbackWarning
_fallbacks = 0


def backward_fallbacks() -> int:
    """How many backward calls of this process were computed in 16 bits by torch instead of by
    SageBwd: the ones its accuracy check refused, and the ones sent there directly because that
    check kept refusing their kind of call (set_backward_retry)."""
    return _fallbacks


# Where SageBwd's check refuses a kind of call again and again (a trained model's attention:
# outlier channels, sinks, peaked rows), each 8-bit attempt costs the pre-pass, the statistics
# pass and a host synchronization before the 16-bit backward that replaces it. So after two
# refusals in a row of one kind of call (device, dtype, layout, mask, heads, head dim, whether
# the LSE has a gradient: the layers of a model share it), the next 2^(r-1) calls of that kind
# (r the refusals in a row, at most 64 calls) go straight to 16 bits, and the one after tries
# 8 bits again; an accepted attempt ends the run. Only the verdict is remembered, never the
# gradients, and the 16-bit path is the accurate one, so this changes speed, not what is
# returned. Not while tracing or under graph capture, where no verdict is read.
_retry = True
_skips: dict = {}  # kind of call -> [refusals in a row, calls left to send straight to 16 bits]
_SKIP_MAX = 64


def set_backward_retry(enabled: bool) -> None:
    """True (default): after two refusals in a row of one kind of backward call, SageBwd's
    8-bit attempt is skipped for a growing number of that kind's calls (up to 64), which go
    straight to 16 bits. False: every backward call tries 8 bits and is checked (to count how
    many calls the check refuses)."""
    global _retry
    _retry = bool(enabled)
    _skips.clear()


def _kind(q, k, layout, mask, d_lse):
    """The kind of backward call set_backward_retry remembers, or None where it does not apply:
    the policy off, a tracer's tensors, CUDA-graph capture (no verdict can be read there, and a
    captured graph should not depend on the calls before it)."""
    if not _retry or _traced(q) or (q.device.type == "cuda" and
                                    torch.cuda.is_current_stream_capturing()):
        return None
    hi = 1 if layout == _lib.LAYOUT_HND else q.dim() - 2
    return (q.device, q.dtype, layout, mask, d_lse is None, q.shape[hi], k.shape[hi],
            q.shape[-1])


def _skip_8bit(kind):
    """Whether this backward call goes straight to 16 bits (and takes one call off the run)."""
    st = _skips.get(kind)
    if st is None or st[1] == 0:
        return False
    st[1] -= 1
    return True


def _record_verdict(kind, refused):
    if not refused:
        _skips.pop(kind, None)
        return
    st = _skips.setdefault(kind, [0, 0])
    st[0] += 1
    st[1] = min(1 << (st[0] - 1), _SKIP_MAX) if st[0] >= 2 else 0


def _backward_16bit(q, k, v, d_o, d_lse, layout, mask, scale):
    """The gradients by torch in the inputs' precision: SDPA's own backward where SDPA computes
    this attention (no LSE gradient; no mask, top-left causal, or square), else the textbook
    backward in float32, a chunk of query rows at a time (memory B·H·chunk·Nk floats)."""
    if layout != _lib.LAYOUT_HND:
        q, k, v, d_o = (x.transpose(1, 2) for x in (q, k, v, d_o))
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    causal = mask != _lib.MASK_NONE
    if d_lse is None and (not causal or mask == _lib.MASK_CAUSAL_TOP_LEFT or Nq == Nk):
        # K and V repeated over the group rather than enable_gqa, which only torch's flash
        # kernel takes: this way the cuDNN kernel (the fastest backward on Hopper) can run it.
        with torch.enable_grad():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            ke, ve = ((x.repeat_interleave(G, dim=1) if G > 1 else x) for x in (kk, vv))
            out = _torch_sdpa(qq, ke, ve, is_causal=causal, scale=scale)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), d_o)
    else:
        f = torch.float32
        kf = k.to(f).repeat_interleave(G, dim=1)
        vf = v.to(f).repeat_interleave(G, dim=1)
        dq = torch.empty(q.shape, dtype=f, device=q.device)
        dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
        offset = (Nk - Nq if mask == _lib.MASK_CAUSAL_BOTTOM_RIGHT else 0) if causal else None
        chunk = max(1, (1 << 26) // max(1, B * Hq * Nk))
        for i0 in range(0, Nq, chunk):
            i1 = min(Nq, i0 + chunk)
            qc, doc = q[:, :, i0:i1].to(f), d_o[:, :, i0:i1].to(f)
            s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
            if causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(Nk, device=q.device)[None, :]
                s = s.masked_fill(cols > rows + offset, float("-inf"))
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.exp(s - lse.masked_fill(torch.isinf(lse) & (lse < 0), 0.0))
            dp = torch.matmul(doc, vf.transpose(-1, -2))
            g = d_lse[:, :, i0:i1, None].to(f) if d_lse is not None else 0.0
            ds = p * (dp - (p * dp).sum(-1, keepdim=True) + g)
            dq[:, :, i0:i1] = torch.matmul(ds, kf) * scale
            dkf += torch.matmul(ds.transpose(-1, -2), qc) * scale
            dvf += torch.matmul(p.transpose(-1, -2), doc)
        dk = dkf.view(B, Hkv, G, Nk, D).sum(2)
        dv = dvf.view(B, Hkv, G, Nk, D).sum(2)
        dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if layout != _lib.LAYOUT_HND:
        dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    return dq, dk, dv


def _launch_backward(q, k, v, d_o, d_lse, layout, mask, scale, family, out, untrusted,
                     workspace=None):
    """One sage_attention_backward() call writing out = (dq, dk, dv) and the verdict into
    untrusted (an int32 element, read by the caller). workspace: a device buffer at least this
    call's size (allocated here when None)."""
    dq, dk, dv = out
    hi, ni = (1, 2) if layout == _lib.LAYOUT_HND else (2, 1)
    a = _lib.new_backward_args()
    a.q, a.k, a.v, a.o, a.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None
    a.d_o = d_o.data_ptr()
    a.d_lse = d_lse.data_ptr() if d_lse is not None else None
    a.dq, a.dk, a.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    a.batch, a.heads_q, a.heads_kv = q.shape[0], q.shape[hi], k.shape[hi]
    a.seq_q, a.seq_kv, a.head_dim = q.shape[ni], k.shape[ni], q.shape[3]
    a.layout = layout
    for field, x in (("q_strides", q), ("k_strides", k), ("v_strides", v), ("do_strides", d_o),
                     ("dq_strides", dq), ("dk_strides", dk), ("dv_strides", dv)):
        _lib.set_strides(getattr(a, field), layout, list(x.stride()))
    if d_lse is not None:
        _lse_strides(a.dlse_strides, d_lse)
    a.dtype = _DTYPE_CODES[q.dtype]
    a.scale = scale
    a.mask = mask
    if torch.are_deterministic_algorithms_enabled():  # (the CPU reference is either way)
        a.options = _lib.BWD_OPTION_DETERMINISTIC
    a.untrusted = untrusted.data_ptr()
    if q.is_cuda:
        with torch.cuda.device(q.device):
            a.backend = _lib.BACKEND_CUDA
            a.stream = _current_stream(q.device)
            a.kernel = family
            n = _lib.backward_workspace_size(a)
            if workspace is None or workspace.numel() < n:
                workspace = q.new_empty((max(n, 1),), dtype=torch.uint8)
            a.workspace, a.workspace_size = workspace.data_ptr(), workspace.numel()
            _lib.run_backward(a)
    else:
        a.backend = _lib.BACKEND_CPU
        _lib.run_backward(a)
    return workspace


def _verdicts_readable(untrusted):
    """Whether the check's verdicts (untrusted, the backward's int32 flags) can be read now: not
    while a tracer stands in for them, not under CUDA-graph capture."""
    if _traced(untrusted):
        return False
    if untrusted.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if "capture" not in _warned:
            _warned.add("capture")
            warnings.warn("sage_attn: under CUDA-graph capture SageBwd's accuracy check cannot hand "
                          "a backward to 16 bits: a call it rejects returns NaN gradients",
                          SageBwdFallbackWarning, stacklevel=3)
        return False
    return True


def _sage_backward(op, q, k, v, d_o, d_lse, layout, mask, scale, family=0):
    """SageBwd's dq, dk, dv by op (_backward_op or _backward), or None where this call's
    gradients must be computed in 16 bits by the caller, here where autograd records: SageBwd
    normalizes its own scores and checks them (docs/backward.md), and where it estimates its INT8
    scores too coarse for gradients it can stand behind they are NaN and its verdict says so
    (one host synchronization a call reads it; the refusal is counted and warned about); or the
    check kept refusing this kind of call, which then skips the attempt (set_backward_retry;
    counted). Under CUDA-graph capture or while compiling nothing can be read: the NaN stays."""
    kind = _kind(q, k, layout, mask, d_lse)
    if kind is not None and _skip_8bit(kind):
        _count_fallbacks(1)
        return None
    dq, dk, dv, untrusted = op(q, k, v, d_o, d_lse, layout, mask, scale, family)
    readable = _verdicts_readable(untrusted)
    refused = readable and bool(untrusted.item())
    if kind is not None and readable:
        _record_verdict(kind, refused)
    if refused:
        _note_fallback(stacklevel=4)  # (the warning points where the backward was called)
        return None
    return dq, dk, dv


def _count_fallbacks(calls):
    global _fallbacks
    _fallbacks += calls


def _note_fallback(calls=1, stacklevel=3):
    _count_fallbacks(calls)
    warnings.warn("sage_attn: SageBwd's accuracy check estimated the INT8 scores of this call too "
                  "coarse for its gradients (outlier channels or peaked rows): they were computed "
                  "in 16 bits by torch instead (sage_attn.backward_fallbacks() counts these; after "
                  "two refusals in a row, calls of this kind go straight to 16 bits for a while: "
                  "sage_attn.set_backward_retry)",
                  SageBwdFallbackWarning, stacklevel=stacklevel)


def _backward(q, k, v, d_o, d_lse, layout, mask, scale, family=0):
    """dq, dk, dv of the attention of q, k, v against dO (SageBwd on CUDA tensors, the CPU
    reference's SageBwd emulation on CPU ones), and its verdict (int32 [1], 1: refused, the
    gradients NaN). d_lse may be None. family: the forward's kernel choice
    (sage_backward_args.kernel: the same family runs the backward)."""
    if d_o.stride(-1) != 1:  # (autograd hands expanded or transposed gradients too)
        d_o = d_o.contiguous()
    if d_lse is not None and d_lse.stride(-1) != 1:
        d_lse = d_lse.contiguous()
    out = (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))
    untrusted = torch.empty((1,), dtype=torch.int32, device=q.device)
    _launch_backward(q, k, v, d_o, d_lse, layout, mask, scale, family, out, untrusted)
    return (*out, untrusted)


@torch.library.custom_op("sage_attn::attention_backward", mutates_args=())
def _backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_o: torch.Tensor,
                 d_lse: Optional[torch.Tensor], layout: int, mask: int, scale: float,
                 family: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(q, k, v, d_o, d_lse, layout, mask, scale, family)


@_backward_op.register_fake
def _(q, k, v, d_o, d_lse, layout, mask, scale, family=0):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device),
            torch.empty((1,), dtype=torch.int32, device=q.device))


def _setup_context(ctx, inputs, output):
    c = _Call.from_op_args(inputs)
    _, lse = output
    # Not O: SageBwd normalizes its own scores. The LSE (small) says whether SDPA ran instead.
    ctx.save_for_backward(c.q, c.k, c.v, lse)
    ctx.call = c._replace(q=None, k=None, v=None)  # (the tensors travel as saved tensors)
    # An output the loss does not use arrives as None, not as zeros: an LSE nobody asked for
    # (autograd always computes it) must not look like a gradient on it, which would take the
    # 16-bit fallback off SDPA's kernels.
    ctx.set_materialize_grads(False)


def _attention_grad(ctx, d_o, d_lse):
    q, k, v, lse = ctx.saved_tensors
    c = ctx.call
    layout, mask, scale, family = c.layout, c.mask, c.scale, c.family
    nones = (None,) * (len(_Call._fields) - 3)  # no gradient for the op's non-tensor arguments
    if lse.numel() == 0:
        # The op handed the call to torch's SDPA (the drop-in's fallback inside a compiled
        # graph): the gradient is SDPA's, by its own autograd.
        if d_o is None:
            return (None, None, None, *nones)
        return (*_backward_16bit(q, k, v, d_o, None, layout, mask, scale), *nones)
    if d_lse is not None and d_lse.numel() == 0:
        d_lse = None
    if d_o is None:  # only the LSE reaches the loss
        d_o = q.new_zeros(q.shape)
    grads = _sage_backward(_backward_op, q, k, v, d_o, d_lse, layout, mask, scale, family)
    if grads is None:
        grads = _backward_16bit(q, k, v, d_o, d_lse, layout, mask, scale)
    return (*grads, *nones)


_attention_op.register_autograd(_attention_grad, setup_context=_setup_context)


# What sends a call through the op instead of the direct path: a dispatch or function mode, and
# torch.func transforms (vmap, grad), whose tensors pass for plain ones but hold no storage of
# their own (vmap: torch's per-slice fallback). A torch without one of these probes has none of
# what it asks about.
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_function_mode_on = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: False)
_functorch_on = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _traced(x):
    """Whether x is a tracer's stand-in (dynamo, or AOT autograd's trace of a backward, which
    older torch does not report through is_compiling): its value cannot be read."""
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        return True
    proxy = getattr(torch._C, "_TorchDispatchModeKey", None)
    return proxy is not None and torch._C._get_dispatch_mode(proxy.PROXY) is not None


def _call(c: _Call, prep=None):
    """_attention directly where nothing needs to see the op: eager, plain tensors (no
    subclass such as FakeTensor), no gradient wanted, no torch.func transform, no dispatch or
    function mode (profilers, flop counters, fake-tensor tracing); the custom op everywhere
    else. prep: the call's _Prepared where the caller has it (used by the direct path only: the
    op plans its own)."""
    q, k, v = c.q, c.k, c.v
    eager = (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
             and not torch.compiler.is_compiling()
             and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or
                                                   v.requires_grad))
             and _dispatch_stack_len() == 0 and not _function_mode_on()
             and not _functorch_on())
    if eager:
        return _attention(c, prep)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # The backward needs the LSE: computed whether or not the caller asked for it.
        c = c._replace(return_lse=True)
    return _attention_op(*c.op_args())


def _check_tensors(q, k, v, layout_name):
    # The common case in one expression (host time: every check below costs a few attribute
    # reads a tensor); anything else goes through the checks that name what is wrong.
    tensor = torch.Tensor
    if (type(q) is tensor and type(k) is tensor and type(v) is tensor):
        dt, qs, ks = q.dtype, q.shape, k.shape
        if (dt is k.dtype and dt is v.dtype and (dt in _GPU_DTYPES or not q.is_cuda)
                and dt in _DTYPE_CODES and q.device == k.device == v.device and len(qs) == 4
                and len(ks) == 4 and ks == v.shape and qs[0] == ks[0] and qs[3] == ks[3]
                and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1):
            return
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        allowed = _GPU_DTYPES if x.is_cuda else _GPU_DTYPES + (torch.float32,)
        if x.dtype not in allowed:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported; pass float16 or bfloat16"
                            + ("" if x.is_cuda else " (or float32 on the CPU)"))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device (got {q.device}, {k.device}, {v.device})")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions ({'[B,H,N,D]' if layout_name == 'HND' else '[B,N,H,D]'}"
                             f" for tensor_layout={layout_name!r}), got shape {tuple(x.shape)}")
        if x.stride(-1) != 1 and x.shape[-1] > 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got "
                             f"strides {tuple(x.stride())}; call .contiguous() first")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"k: batch {k.shape[0]} must equal q's {q.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"k: head_dim {k.shape[3]} must equal q's {q.shape[3]}")


def sageattn3(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, *,
              causal_align="bottom_right"):
    """SageAttention3's FP4 attention (its paper's Algorithm 1): NVFP4 Q·Kᵀ with K smoothed and Q
    smoothed per 128-row block (plus its ΔS correction), P̃ in two-level NVFP4, V in NVFP4.
    FP4 tensor cores are Blackwell's: on CUDA tensors (sm_89+) this computes exactly what an FP4
    kernel would, with the values dequantized to fp16 on fp16 tensor cores (a reference-exact
    path, not a fast one); on CPU tensors the CPU emulation runs. Shapes, dtypes, masks and the
    return as sageattn (D 64 or 128 on the GPU). Inference only: no backward."""
    if tensor_layout not in _lib.LAYOUTS:
        raise ValueError(f"tensor_layout = {tensor_layout!r}: must be 'HND' or 'NHD'")
    _lib.check_call_flags(causal_align, is_causal, return_lse)
    _check_tensors(q, k, v, tensor_layout)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("sageattn3 has no backward (SageBwd is 8-bit: use sageattn)")
    scale = _scale(sm_scale, q.shape[-1], "sm_scale")
    mask = _lib.CAUSAL_ALIGNS[causal_align] if is_causal else _lib.MASK_NONE
    o, lse = _call(_Call(q, k, v, _lib.LAYOUTS[tensor_layout], mask, scale,
                         qk_bits=_lib.QK_BITS_FP4, smooth_q=None, smooth_k=None, smooth_v=None,
                         return_lse=return_lse, fallback=_RAISE, family=KERNELS[None]))
    return (o, lse) if return_lse else o


def _kernel_code(kernel):
    """The library's kernel choice for sageattn's and sageattn_varlen's `kernel` argument."""
    if not isinstance(kernel, (str, type(None))) or kernel not in KERNELS:
        raise ValueError(f"kernel = {kernel!r}: must be None, 'auto', 'mma' or 'sm90'")
    return KERNELS[kernel]


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, *,
             qk_bits=None, smooth_k=True, smooth_q=None, smooth_v=None,
             causal_align="bottom_right", kernel=None):
    """SageAttention2: INT8 (qk_bits=8, default) or INT4 (qk_bits=4) Q·Kᵀ with per-thread scales,
    FP8 P̃·V. q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D] in HND (or [B,N,H,D] with tensor_layout="NHD");
    Hq a multiple of Hkv (GQA/MQA); D a multiple of 8 from 8 to 256 on the GPU; fp16 or bf16 (fp32
    too on the CPU, where the exact CPU emulation runs). is_causal masks with the alignment
    causal_align ("bottom_right" as FlashAttention, "top_left" as torch SDPA). smooth_q None = on
    for 4-bit only; smooth_v None = on (V's exact channel mean: a pass over V; False is faster
    at short lengths). Returns o, or (o, lse) with
    lse [B,Hq,Nq] float32, the natural log of each row's softmax denominator. kernel (CUDA):
    None/"auto" the library's choice, "mma" the portable mma.sync kernel, "sm90" the Hopper wgmma
    kernel (ValueError where it has no kernel for the call).

    Differentiable: with inputs that require grad, .backward() runs SageBwd (SageAttention3: the
    recomputed Q·Kᵀ, Pᵀ·dO, dS·K and dSᵀ·Q in INT8, dO·Vᵀ in fp16/bf16; D 64/128 on the GPU, the
    CPU reference's emulation on CPU tensors); a gradient reaching the returned LSE is included.
    Under torch.use_deterministic_algorithms(True) the CUDA backward sums dQ in a fixed order
    instead of with atomics: the same gradient bits on every run (dK, dV are anyway)."""
    fast = _fast is not None and return_lse is False and not torch.compiler.is_compiling()
    if fast:
        o = _fast.sageattn(q, k, v, tensor_layout, is_causal, sm_scale, qk_bits, smooth_k,
                           smooth_q, smooth_v, causal_align, kernel)
        if o is not None:
            return o
    if tensor_layout not in _lib.LAYOUTS:
        raise ValueError(f"tensor_layout = {tensor_layout!r}: must be 'HND' or 'NHD'")
    _lib.check_call_flags(causal_align, is_causal, return_lse)
    if qk_bits is not None and (isinstance(qk_bits, bool) or qk_bits not in (4, 8)):
        raise ValueError(f"qk_bits = {qk_bits!r}: must be 8, 4 or None (8)")
    kernel_code = _kernel_code(kernel)
    _check_tensors(q, k, v, tensor_layout)
    layout = _lib.LAYOUTS[tensor_layout]
    scale = _scale(sm_scale, q.shape[-1], "sm_scale")
    mask = _lib.CAUSAL_ALIGNS[causal_align] if is_causal else _lib.MASK_NONE
    for name, value in (("smooth_q", smooth_q), ("smooth_k", smooth_k), ("smooth_v", smooth_v)):
        _lib.check_flag(name, value)
    c = _Call(q, k, v, layout, mask, scale, qk_bits=qk_bits, smooth_q=smooth_q,
              smooth_k=smooth_k, smooth_v=smooth_v, return_lse=return_lse, fallback=_RAISE,
              family=kernel_code)
    o, lse = _call(c)
    if (fast and type(q) is _Tensor and q.is_cuda and not _training(q, k, v)
            and _dispatch_stack_len() == 0 and not _function_mode_on() and not _functorch_on()
            and (_fast_ready or _fast_configure())):
        # The plan this call ran is the fast path's for the next one with the same key. Not a
        # call that trains (it needs the op, for autograd: the key refuses it too) nor one under a
        # mode (the fast path answers none): each of those would pay the lookup and come back.
        try:
            prep = _prepared.get(_key(c))
        except RuntimeError:  # (a tensor without storage: nothing planned to keep)
            prep = None
        if type(prep) is _Prepared:
            _fast.remember_sageattn(q, k, v, tensor_layout, is_causal, sm_scale, qk_bits,
                                    smooth_k, smooth_q, smooth_v, causal_align, kernel,
                                    prep.args, prep.workspace_alloc)
    return (o, lse) if return_lse else o


def sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    is_causal=False, sm_scale=None, return_lse=False,
                    causal_align="bottom_right", *, qk_bits=None, smooth_k=True, smooth_q=None,
                    smooth_v=None, kernel=None):
    """SageAttention2 of a packed variable-length batch, with flash_attn_varlen_func's
    conventions: q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens_q/k int32 [batch + 1]
    cumulative lengths (start 0, non-decreasing), max_seqlen_q/k the longest sequence's lengths.
    Each sequence is its own problem: causal alignment (causal_align as in sageattn), smoothing
    means and quantization groups never cross a sequence. Returns o (q's shape), or (o, lse)
    with lse [Hq, total_q] float32 (FlashAttention's varlen layout); a sequence with queries but
    no keys gives o = 0, lse = -inf.

    CUDA tensors (cu_seqlens on the same device) run the GPU kernels without reading
    cu_seqlens on the host: no synchronization, so the call can be captured in a CUDA graph and
    replayed with new cu_seqlens contents of the same batch size (max_seqlen_q/k and the totals
    fixed at capture bound them). The GPU does not check cu_seqlens' contents: lengths that break
    the conventions leave rows unwritten (never memory outside the tensors). CPU tensors run the
    library's CPU reference, which checks them. Differentiable: each sequence's gradients are
    SageBwd's of that sequence alone (as a dense sageattn call of it computes them; the backward
    reads cu_seqlens on the host). kernel: None (the library's choice: on sm_90 the wgmma kernel for 8-bit
    calls whose q rows it can read, else mma.sync), "mma" or "sm90", as in sageattn."""
    _lib.check_call_flags(causal_align, is_causal, return_lse)
    named = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
             ("cu_seqlens_k", cu_seqlens_k))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    for name, x in named[1:]:
        if x.device != q.device:
            raise ValueError(f"{name}: on {x.device}, but q is on {q.device} (every tensor of "
                             "the call, cu_seqlens included, must be on one device)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _DTYPE_CODES:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported; pass float16, bfloat16 "
                            "or float32")
        if x.dim() != 3:
            raise ValueError(f"{name}: expected 3 dimensions [total_tokens, H, D], got shape "
                             f"{tuple(x.shape)}")
    _lib.check_packed_qkv(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D int32 tensor (batch + 1 cumulative "
                            f"lengths), got {cu.dtype} of shape {tuple(cu.shape)}")
    _lib.check_cu_seqlens_counts(cu_seqlens_q.shape[0], cu_seqlens_k.shape[0])
    for name, value in (("smooth_q", smooth_q), ("smooth_k", smooth_k), ("smooth_v", smooth_v)):
        _lib.check_flag(name, value)
    kernel_code = _kernel_code(kernel)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    scale = _scale(sm_scale, q.shape[-1], "sm_scale")
    mask = _lib.CAUSAL_ALIGNS[causal_align] if is_causal else _lib.MASK_NONE
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        o, lse = _VarlenAttention.apply(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask,
                                        scale, (qk_bits, smooth_q, smooth_k, smooth_v),
                                        kernel_code, return_lse)
        return (o, lse) if return_lse else o
    o, lse = _varlen_forward(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask, scale,
                             (qk_bits, smooth_q, smooth_k, smooth_v), kernel_code, return_lse)
    return (o, lse) if return_lse else o


def _varlen_forward(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask, scale, quant,
                    kernel_code, return_lse):
    """sageattn_varlen's forward on checked arguments: (o, lse or None)."""
    qk_bits, smooth_q, smooth_k, smooth_v = quant
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = (torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
           if return_lse else None)
    a = _lib.new_args()
    a.q, a.k, a.v, a.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    a.lse = lse.data_ptr() if lse is not None else None
    _lib.set_packed(a, q.shape, k.shape, cu_q.data_ptr(), cu_k.data_ptr(), cu_q.shape[0] - 1,
                    max_seqlen_q, max_seqlen_k,
                    {f: (x.stride(0), x.stride(1)) for f, x in
                     (("q_strides", q), ("k_strides", k), ("v_strides", v), ("o_strides", o))})
    a.dtype = _DTYPE_CODES[q.dtype]
    a.scale = scale
    a.mask = mask
    a.variant, a.quant = _lib.quant_settings(qk_bits, smooth_q, smooth_k, smooth_v)
    if not q.is_cuda:
        a.backend = _lib.BACKEND_CPU
        _lib.run(a)
        return o, lse
    if q.dtype == torch.float32:
        raise TypeError("q: float32 CUDA tensors have no GPU kernel; pass float16 or bfloat16")
    a.backend = _lib.BACKEND_CUDA
    a.kernel = kernel_code
    with torch.cuda.device(q.device):
        a.stream = _current_stream(q.device)
        # The workspace from torch's caching allocator (graph-capturable; sized from the shapes,
        # max_seqlen and the totals only: the planner never reads cu_seqlens).
        size = _lib.workspace_size(a)
        ws = torch.empty((max(size, 1),), dtype=torch.uint8, device=q.device)
        a.workspace, a.workspace_size = ws.data_ptr(), size
        _lib.run(a)
    return o, lse


class _VarlenAttention(torch.autograd.Function):
    """sageattn_varlen with a backward: each sequence's gradients are SageBwd's of that sequence
    alone, one backward call a sequence on views of the packed tensors (the same call, inputs and
    kernel family as a dense sageattn of that sequence: bit-identical to it under
    torch.use_deterministic_algorithms(True)). The backward reads cu_seqlens on the host and
    every sequence's verdict with one synchronization; a sequence the check refuses is
    recomputed in 16 bits by torch."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask, scale, quant,
                kernel_code, return_lse):
        o, lse = _varlen_forward(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask, scale,
                                 quant, kernel_code, return_lse)
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        ctx.attn = (mask, scale, kernel_code)
        ctx.set_materialize_grads(False)  # (as the dense op: an unused LSE's gradient is None)
        return o, lse

    @staticmethod
    def backward(ctx, d_o, d_lse):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        mask, scale, family = ctx.attn
        if d_o is None:  # only the LSE reaches the loss
            d_o = q.new_zeros(q.shape)
        if d_o.stride(-1) != 1:
            d_o = d_o.contiguous()
        if d_lse is not None and d_lse.stride(-1) != 1:
            d_lse = d_lse.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        batch = len(starts_q) - 1
        untrusted = torch.zeros((max(batch, 1),), dtype=torch.int32, device=q.device)
        runs, ws = [], None
        # (Sequences of one packed call are one call of their kind for set_backward_retry.)
        kind = _kind(q, k, _lib.LAYOUT_NHD, mask, d_lse)
        direct = kind is not None and _skip_8bit(kind)
        for b in range(batch):
            q0, q1 = starts_q[b], min(starts_q[b + 1], q.shape[0])
            k0, k1 = starts_k[b], min(starts_k[b + 1], k.shape[0])
            if q1 <= q0 or k1 <= k0:  # no query, or no key: every gradient of it is 0
                continue
            views = [x[lo:hi].unsqueeze(0) for x, lo, hi in
                     ((q, q0, q1), (k, k0, k1), (v, k0, k1), (d_o, q0, q1))]
            dl = d_lse[:, q0:q1].unsqueeze(0) if d_lse is not None else None
            out = (dq[q0:q1].unsqueeze(0), dk[k0:k1].unsqueeze(0), dv[k0:k1].unsqueeze(0))
            if not direct:
                ws = _launch_backward(*views, dl, _lib.LAYOUT_NHD, mask, scale, family, out,
                                      untrusted[b:b + 1], ws)
            runs.append((b, views, dl, out))
        sixteen = []  # the sequences computed in 16 bits
        if direct:
            sixteen = runs
            _count_fallbacks(len(runs))
        elif runs and _verdicts_readable(untrusted):
            flags = untrusted.tolist()
            sixteen = [r for r in runs if flags[r[0]]]
            if kind is not None:
                _record_verdict(kind, bool(sixteen))
            if sixteen:
                _note_fallback(len(sixteen))
        for _, views, dl, out in sixteen:
            for dst, src in zip(out, _backward_16bit(*views, dl, _lib.LAYOUT_NHD, mask, scale)):
                dst.copy_(src)
        return dq, dk, dv, *(None,) * 9


def _scale(scale, head_dim, name):
    if scale is None:
        # (head_dim 0: any scale; the library refuses the head dim by name)
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} = {scale!r}: must be a number or None")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"{name} = {scale!r}: must be positive and finite")
    return float(scale)


def _sdpa_unsupported(query, key, value, attn_mask, dropout_p, scale, enable_gqa, cpu=False):
    """Why the SDPA drop-in hands this call to torch, or None when the library takes it.
    cpu=True (sage_attn.mix): CPU tensors are taken too (the CPU reference; float32 as well)."""
    for x in (query, key, value):
        if not isinstance(x, torch.Tensor):
            return "non-tensor inputs"
    if attn_mask is not None:
        return "attn_mask is not supported (only is_causal)"
    if dropout_p != 0.0:
        return "dropout_p > 0 is not supported"
    if not (query.is_cuda and key.is_cuda and value.is_cuda) and not cpu:
        return "non-CUDA tensors"
    if not (query.device == key.device == value.device):
        return "tensors on different devices"
    dtypes = _GPU_DTYPES if query.is_cuda else _GPU_DTYPES + (torch.float32,)
    if query.dtype not in dtypes or not (query.dtype == key.dtype == value.dtype):
        return f"dtype {query.dtype} (only float16 and bfloat16 with one dtype for q, k, v)"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs that are not 4-D [B, H, N, D]"
    # (Which head dims have a kernel is the library's to say: the plan, below.)
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return f"head_dim {query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]} (must be equal)"
    if key.shape != value.shape or key.shape[0] != query.shape[0]:
        return "key/value/query shapes that do not match"
    hq, hkv = query.shape[1], key.shape[1]
    # Unequal heads: GQA with enable_gqa, or SDPA's broadcasting of a single key/value head.
    if hq != hkv and hkv != 1 and (not enable_gqa or hq % hkv != 0):
        return "query and key head counts that SDPA would reject"
    if min(query.shape[2], key.shape[2], query.shape[0], hq) == 0:
        return "empty inputs"
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        return f"scale = {scale!r}"
    return None


_use_crossover = True


def set_dropin_crossover(enabled: bool) -> None:
    """The SDPA drop-in hands shapes where the library's crossover model (fitted per GPU
    architecture, head dim and mask) says torch's own SDPA is faster to torch, and every call on
    a kind of GPU the model has no measurements of (the default).
    set_dropin_crossover(False): the drop-in runs sage wherever it can."""
    global _use_crossover
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled = {enabled!r}: must be a bool")
    _use_crossover = enabled
    if _fast is not None:  # (its keys leave the switch out)
        _fast.clear()


def _dropin_call(q, k, v, layout, mask, scale, fallback):
    """The SDPA drop-in's call: the SageAttn2-8b preset, no LSE, the library's kernel."""
    # (Positional: a NamedTuple parses keywords in Python, and this runs on every drop-in call.)
    return _Call(q, k, v, layout, mask, scale, None, None, None, None, False, fallback,
                 _lib.KERNEL_AUTO)


def _dropin_args(query, key, value):
    # SDPA takes any strides; the kernels need a contiguous head_dim.
    q = query if query.stride(-1) == 1 else query.contiguous()
    k = key if key.stride(-1) == 1 else key.contiguous()
    v = value if value.stride(-1) == 1 else value.contiguous()
    return q, k, v


def _dropin_route(q, k, v, mask, scale, training=False):
    """None: the drop-in runs sage; else it hands the call to torch's SDPA, with this reason to
    warn about ("": the crossover model, silently). training: the inputs require grad, so the
    library must have the backward too (its plan says)."""
    return _dropin_plan(q, k, v, mask, scale, training)[0]


def _dropin_plan(q, k, v, mask, scale, training=False):
    """(_dropin_route's answer, the _Prepared its sage run uses: None unless it runs sage)."""
    try:
        prep = _plan_of(q, k, v, _lib.LAYOUT_HND, mask, scale)
    except _lib.SageUnsupportedError as e:
        return f"no kernel for this call ({e})", None
    _sdpa_below[q.device] = prep.sdpa_below
    if prep.sdpa_below >= _NEVER_MEASURED and _use_crossover:
        major, minor = torch.cuda.get_device_capability(q.device)
        _warn_once(f"this GPU (sm_{major}{minor}) was never measured against torch's SDPA, so the "
                   "SDPA drop-in and the integrations hand it every call "
                   "(set_dropin_crossover(False) runs sage wherever it can)")
    if training and not prep.has_backward:
        return f"no backward kernel for head_dim {q.shape[-1]} (training)", None
    faster = prep.prefer_sdpa_training if training else prep.prefer_sdpa
    return ("", None) if _use_crossover and faster else (None, prep)


def _dropin_prefers_sdpa(q, k, v, mask, scale, training=False):
    route = _dropin_route(q, k, v, mask, scale, training)
    return route == "" or (training and route is not None)


class _Route:
    """The drop-in's answer for one call. reason None: sage runs it, with this mask and scale,
    copy saying whether an input needs a contiguous head dim first, and prep the plan of the
    run (None where an input is copied: the copy's alignment is its allocation's, which the
    signature does not record, so its run looks the plan up). Else torch's SDPA runs it, with
    reason to warn about ("": the crossover model's choice, silent). direct: sage runs the
    inputs as given, planned (prep), and nothing needs to see the op (plain tensors, no
    gradient wanted; dispatch and function modes are asked each call): the drop-in launches it
    itself, on an output of `shape` (the query's) on `device` (the query's). fallback: the
    op's _FALLBACK_SDPA where the op itself decides (a call under a torch.func transform, whose
    tensors have no storage to plan with: the op decides per slice), else _FALLBACK_SDPA_ROUTED."""
    __slots__ = ("reason", "mask", "scale", "copy", "prep", "direct", "shape", "device",
                 "fallback")

    def __init__(self, reason, mask=None, scale=None, copy=False, prep=None, direct=False,
                 shape=None, device=None, fallback=_FALLBACK_SDPA_ROUTED):
        self.reason, self.mask, self.scale, self.copy, self.prep = reason, mask, scale, copy, prep
        self.direct, self.shape, self.device = direct, shape, device
        self.fallback = fallback


# The answer for a call shorter than its device's least routed length (_dropin_route_of): torch's
# SDPA, silently. The query alone is read, so such a call skips the one-time warnings the full
# decision would give about anything else (the key and value, the heads, the scale, a backward
# the library does not have): it goes to torch's SDPA either way. (A head dim the library never
# takes still gets its warning: the shortcut leaves it to the full decision.)
_SHORT = _Route("")


def _dropin_decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The drop-in's _Route for this call, every check run."""
    reason = _sdpa_unsupported(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    if reason is not None:
        return _Route(reason)
    q, k, v = _dropin_args(query, key, value)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mask = _lib.MASK_CAUSAL_TOP_LEFT if is_causal else _lib.MASK_NONE
    if _functorch_on():
        return _Route(None, mask, s, q is not query or k is not key or v is not value,
                      fallback=_FALLBACK_SDPA)
    training = _training(query, key, value)
    reason, prep = _dropin_plan(q, k, v, mask, s, training)
    copy = q is not query or k is not key or v is not value
    if copy:
        prep = None
    direct = (prep is not None and not training and type(query) is _Tensor
              and type(key) is _Tensor and type(value) is _Tensor)
    return _Route(reason, mask, s, copy, prep, direct, tuple(query.shape), query.device)


# Decided drop-in calls by signature (_dropin_route_of), so that a repeated call pays one tuple
# of attribute reads and one lookup for its checks, its route and its plan.
_routes: dict = {}
# Per CUDA device, from its first plan: the length under which the library's crossover model
# hands every call on that GPU to torch (sage_plan_info.sdpa_below; 0: none by length). A short
# call (ViT, DiT, a low UNet level) then goes to torch's SDPA on three reads of the query, not the
# whole signature; the calls it skips would all have routed there silently.
_sdpa_below: dict = {}
# sdpa_below on a kind of GPU the crossover model has no measurements of (INT64_MAX): every call
# goes to torch's SDPA there.
_NEVER_MEASURED = (1 << 63) - 1


def _shorter_than_routed(shape, device):
    """True where the crossover model hands a call whose 4-D [B, H, N, D] query has this shape
    and device to torch by its length alone (under _sdpa_below of its device; the crossover
    switch on) and D is in the GPU's head-dim range (a multiple of 8 up to 256, sage.h; any
    other meets the plan, which refuses it with a warning): the drop-in's and the registered
    flash op's route skip the rest of the decision for it. (The query's shape and device as read
    by the caller, which reuses them.)"""
    return (_use_crossover and shape[2] < _sdpa_below.get(device, 0)
            and shape[3] % 8 == 0 and 0 < shape[3] <= 256)


def _dropin_route_of(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The drop-in's _Route for this call (_dropin_decide), kept by the call's signature: every
    input the answer reads. Of the tensors: shape, strides, dtype, device and whether the query
    is 16-byte aligned (the plan's key has it); the scalar arguments as given, and the scale's
    type (the checks take an int or float scale only, and a value of another type can compare
    and hash equal to one); whether the call trains (grad mode, requires_grad); the crossover
    switch. Nothing else reaches the answer (torch's deterministic-algorithms setting only
    orders SageBwd's sums, read when it runs; the library's plan reads its arguments alone).
    Only plain tensors without a mask are kept: a subclass may answer attribute reads its own
    way, and a mask is never taken; those, and a call whose signature cannot be formed (an
    unhashable argument, a tensor without strides or storage), run every check each time.

    Before the signature: a plain fp16/bf16 query without a mask or dropout, shorter than its
    device's least routed length (_sdpa_below), gets _SHORT (torch's SDPA, silently) from the
    query's shape, dtype and device alone, which the signature then reuses."""
    sig = None
    if attn_mask is None and type(query) is _Tensor:
        try:
            shape, dtype, device = query.shape, query.dtype, query.device
        except RuntimeError:  # (a strided nested tensor has no shape: the full decision's case)
            shape = None
        if shape is not None:
            if (not dropout_p and len(shape) == 4 and dtype in _GPU_DTYPES
                    and _shorter_than_routed(shape, device)):
                return _SHORT
            if type(key) is _Tensor and type(value) is _Tensor:
                try:
                    sig = (shape, key.shape, value.shape, query.stride(), key.stride(),
                           value.stride(), dtype, key.dtype, value.dtype, device, key.device,
                           value.device, query.data_ptr() % 16 == 0, dropout_p, is_causal,
                           scale, type(scale), enable_gqa, _is_grad_enabled() and (
                               query.requires_grad or key.requires_grad or
                               value.requires_grad),
                           _use_crossover)
                    route = _routes.get(sig)
                except (TypeError, RuntimeError):
                    sig = route = None
                if route is not None:
                    return route
    route = _dropin_decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if sig is not None:
        if len(_routes) >= _PREPARED_MAX:
            _routes.clear()
        _routes[sig] = route
    return route


def dropin_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False) -> str:
    """What scaled_dot_product_attention would run for these arguments: "sage" or "sdpa"
    (torch's own, for arguments the library does not take, training calls whose backward it
    does not have or, by its crossover model, shapes where torch's SDPA is predicted faster on this
    GPU)."""
    route = _dropin_route_of(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)
    return "sage" if route.reason is None else "sdpa"


def _training(query, key, value):
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or
                                        value.requires_grad)


def _fast_keep(route, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Hand the fast path a route it can repeat: torch's SDPA chosen silently (a route with a
    reason warns, once, in Python), where torch's SDPA is torch's own op (not a function put in
    its place before this module was imported); or sage run directly (_Route.direct)."""
    if route.reason == "":
        if _torch_sdpa is _TORCH_SDPA_OP:
            _fast.remember(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                           1, None, 0)
    elif route.reason is None and route.direct and (_fast_ready or _fast_configure()):
        _fast.remember(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       2, route.prep.args, route.prep.workspace_alloc)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention with SDPA's exact semantics (causal is
    top-left aligned; scale defaults to 1/sqrt(E); GQA only with enable_gqa), computed by
    SageAttn2-8b where it can and is faster, by torch's SDPA otherwise: arguments the library
    does not take (a one-time warning per reason; a training call whose backward the library
    does not have is one), and shapes where the library's crossover model says torch's SDPA is
    faster on this GPU (silently; on a kind of GPU the model has no measurements of, every call,
    with one warning; set_dropin_crossover(False) turns that off; under torch.compile the same
    choice is made inside the op). So
    `F.scaled_dot_product_attention = sage_attn.scaled_dot_product_attention` is safe anywhere
    and not slower than SDPA where the table was measured."""
    if torch.compiler.is_compiling():
        # The tracer reads no cache: the checks are traced, and the op makes the choice.
        reason = _sdpa_unsupported(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
        if reason is not None:
            return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                               enable_gqa=enable_gqa)
        q, k, v = _dropin_args(query, key, value)
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        mask = _lib.MASK_CAUSAL_TOP_LEFT if is_causal else _lib.MASK_NONE
        o, _ = _call(_dropin_call(q, k, v, _lib.LAYOUT_HND, mask, s, _FALLBACK_SDPA))
        return o
    if _fast is not None:
        o = _fast.call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if o is not None:
            return o
    route = _dropin_route_of(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)
    if _fast is not None:
        _fast_keep(route, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if route.reason is not None:
        if route.reason:
            _warn_once(route.reason)
        if scale is None and not enable_gqa:  # (torch parses keyword arguments more slowly)
            return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal)
        return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                           enable_gqa=enable_gqa)
    if (route.direct and _dispatch_stack_len() == 0 and not _function_mode_on()
            and not _functorch_on()):
        # What _call -> _attention -> _run_cuda do for this call, with what the route knows.
        o = query.new_empty(*route.shape)
        device = route.device
        try:
            # (_on_device's test inline: the common case, its device current, needs no call.)
            if device.index == torch.cuda.current_device():
                _launch(query, key, value, o, None, route.prep, device)
            else:
                _on_device(device, _launch, query, key, value, o, None, route.prep, device)
        except _lib.SageUnsupportedError as e:
            _sdpa_into(o, query, key, value, route.mask, route.scale, e)
        return o
    q, k, v = _dropin_args(query, key, value) if route.copy else (query, key, value)
    o, _ = _call(_dropin_call(q, k, v, _lib.LAYOUT_HND, route.mask, route.scale,
                              route.fallback), route.prep)
    return o
