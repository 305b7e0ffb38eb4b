"""The public functions of the official `sageattention` package (2.x API), computed by this
library, for code written against that package (diffusers' "sage" attention backends, ComfyUI's
--use-sage-attention, scripts doing `from sageattention import sageattn`).

Every function runs this library's SageAttention2-8b (INT8 Q·Kᵀ, FP8 P̃·V, its own quantization
groups and accumulator), whatever kernel its name names: qk_quant_gran, pv_accum_dtype and
quantization_backend are checked against the values the official package takes and otherwise have
no effect. smooth_k and smooth_v are honoured. Like the SDPA drop-in, a call goes to sage only
where sage measured faster: on CUDA, eagerly and without return_lse, the shapes where the library's
crossover model says torch's SDPA is faster on this GPU (every shape on a kind of GPU never
measured), and calls that train, run torch's SDPA instead, silently
(sage_attn.set_dropin_crossover(False) sends them to sage). Where the library cannot compute a call
it falls back, with a one-time warning per reason, to torch's SDPA: an attn_mask or dropout_p > 0
(which the official package silently ignores), and head dims without a kernel. return_lse=True
gives the LSE [B, H, Nq] (natural log) as the official package does, and cannot fall back (a
ValueError names the argument). Causal masks are bottom-right aligned (the official package
documents is_causal for Nq == Nk only, where the alignments agree). CPU tensors run the library's
CPU reference (slow; for tests). An unknown keyword is a TypeError naming it.

`import sageattention` resolves to this module only after
`sage_attn.install_sageattention_alias()` (opt-in; see there).
"""
from __future__ import annotations

import warnings

import torch

from . import __version__ as _sage_version
from . import _lib
from . import _torch as _t

# The official API version this module mirrors (diffusers asks for >= 2.1.1), with this
# package's version as the local label, so nobody mistakes it for the official build.
__version__ = f"2.2.0+sage.{_sage_version}"

_GRANS = ("per_warp", "per_thread")
_ACCUMS = {
    "sageattn_qk_int8_pv_fp16_cuda": ("fp16", "fp16+fp32", "fp32"),
    "sageattn_qk_int8_pv_fp8_cuda": ("fp32", "fp32+fp32", "fp32+fp16"),
    "sageattn_qk_int8_pv_fp8_cuda_sm90": ("fp32", "fp32+fp32"),
}
# Keywords code written for the official package passes beyond each function's signature.
_EXTRA = ("attn_mask", "dropout_p")
_warned: set = set()


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"sageattention (sage_attn): {reason}; using torch's "
                      "scaled_dot_product_attention", stacklevel=4)


def _extras(fn, kwargs):
    for name in kwargs:
        if name not in _EXTRA:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
    return kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0)


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} = {value!r}: must be one of {', '.join(map(repr, allowed))}")


def _sdpa_fallback(q, k, v, tensor_layout, is_causal, sm_scale, attn_mask, dropout_p):
    """torch's SDPA on the official layouts (bottom-right causal as the sage path; GQA by
    enable_gqa)."""
    if tensor_layout == "NHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if is_causal and attn_mask is None and q.shape[2] != k.shape[2]:
        from torch.nn.attention.bias import causal_lower_right
        attn_mask, is_causal = causal_lower_right(q.shape[2], k.shape[2]), False
    o = _t._torch_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                       scale=sm_scale, enable_gqa=gqa)
    return o.transpose(1, 2) if tensor_layout == "NHD" else o


def _crossover_prefers_sdpa(q, k, v, tensor_layout, is_causal, sm_scale):
    """True where the library's crossover model hands this call to torch's SDPA, as the SDPA
    drop-in would (silently): a shape where SDPA measured faster on this GPU, any call on a kind
    of GPU never measured, a call that trains (SageBwd never measured faster). Eager CUDA calls
    only: CPU tensors run the CPU reference, and under torch.compile or a torch.func transform
    (whose tensors have no storage to plan with) the call runs sage.
    set_dropin_crossover(False) turns it off."""
    if (not _t._use_crossover or type(q) is not torch.Tensor or not q.is_cuda
            or torch.compiler.is_compiling()
            or _t._functorch_on()):
        return False
    _t._check_tensors(q, k, v, tensor_layout)  # (the errors sageattn gives, before the plan)
    if tensor_layout == "NHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    mask = _lib.MASK_CAUSAL_BOTTOM_RIGHT if is_causal else _lib.MASK_NONE
    scale = _t._scale(sm_scale, q.shape[-1], "sm_scale")
    return _t._dropin_prefers_sdpa(q, k, v, mask, scale, training=_t._training(q, k, v))


def _fast_keep(kind, q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v):
    """Hand the C++ fast path (sage_attn._fastpath) this call's route: 3, torch's SDPA (where
    it is torch's own op and no mask object is needed: not a causal call with Nq != Nk), or 4,
    sageattn."""
    if _t._functorch_on():
        return
    if kind == 3:
        if _t._torch_sdpa is not _t._TORCH_SDPA_OP:
            return
        n = 1 if tensor_layout == "NHD" else 2
        if is_causal and q.shape[n] != k.shape[n]:
            return
    _t._fast.remember_alias(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v, kind)


def _run(fn, q, k, v, tensor_layout, is_causal, sm_scale, return_lse, smooth_k, smooth_v,
         kwargs):
    fast = (_t._fast is not None and not kwargs and return_lse is False
            and not torch.compiler.is_compiling())
    if fast:
        route = _t._fast.alias(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v)
        if route is True:
            return _t.sageattn(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                               sm_scale=sm_scale, return_lse=False, smooth_k=smooth_k,
                               smooth_v=smooth_v)
        if route is not None:
            return route
    attn_mask, dropout_p = _extras(fn, kwargs)
    if tensor_layout not in _lib.LAYOUTS:
        raise ValueError(f"tensor_layout = {tensor_layout!r}: must be 'HND' or 'NHD'")
    reason = None
    if attn_mask is not None:
        reason = "attn_mask is not supported by the quantized kernel"
    elif not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p = {dropout_p!r}: must be a number")
    elif dropout_p != 0.0:
        reason = "dropout_p > 0 is not supported by the quantized kernel"
    if reason is None and not return_lse and _crossover_prefers_sdpa(q, k, v, tensor_layout,
                                                                     is_causal, sm_scale):
        o = _sdpa_fallback(q, k, v, tensor_layout, is_causal, sm_scale, None, 0.0)
        if fast:
            _fast_keep(3, q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v)
        return o
    if reason is None:
        try:
            o = _t.sageattn(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                            sm_scale=sm_scale, return_lse=return_lse, smooth_k=smooth_k,
                            smooth_v=smooth_v)
        except _lib.SageUnsupportedError as e:  # valid arguments the library has no kernel for
            reason = f"no kernel for this call ({e})"
        else:
            if fast:
                _fast_keep(4, q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v)
            return o
    if return_lse:
        raise ValueError(f"return_lse=True: {reason}, and torch's SDPA, the fallback, returns "
                         "no LSE")
    _warn_once(reason)
    return _sdpa_fallback(q, k, v, tensor_layout, is_causal, sm_scale, attn_mask, dropout_p)


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False,
             **kwargs):
    """The official package's sageattn (its per-GPU choice of kernel): here SageAttention2-8b.
    q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D] ("HND") or [B,N,H,D] ("NHD"); returns o, or (o, lse)."""
    return _run("sageattn", q, k, v, tensor_layout, is_causal, sm_scale, return_lse, True,
                None, kwargs)


def sageattn_qk_int8_pv_fp16_triton(q, k, v, tensor_layout="HND", quantization_backend="triton",
                                    is_causal=False, sm_scale=None, smooth_k=True,
                                    return_lse=False, **kwargs):
    """The official Triton kernel's signature; computed by SageAttention2-8b."""
    _check_choice("quantization_backend", quantization_backend, ("triton", "cuda"))
    return _run("sageattn_qk_int8_pv_fp16_triton", q, k, v, tensor_layout, is_causal, sm_scale,
                return_lse, smooth_k, None, kwargs)


def sageattn_qk_int8_pv_fp16_cuda(q, k, v, tensor_layout="HND", is_causal=False,
                                  qk_quant_gran="per_thread", sm_scale=None,
                                  pv_accum_dtype="fp32", smooth_k=True, smooth_v=False,
                                  return_lse=False, **kwargs):
    """The official sm80 kernel's signature; computed by SageAttention2-8b (FP8 P̃·V)."""
    _check_choice("qk_quant_gran", qk_quant_gran, _GRANS)
    _check_choice("pv_accum_dtype", pv_accum_dtype, _ACCUMS["sageattn_qk_int8_pv_fp16_cuda"])
    return _run("sageattn_qk_int8_pv_fp16_cuda", q, k, v, tensor_layout, is_causal, sm_scale,
                return_lse, smooth_k, smooth_v, kwargs)


def sageattn_qk_int8_pv_fp8_cuda(q, k, v, tensor_layout="HND", is_causal=False,
                                 qk_quant_gran="per_thread", sm_scale=None,
                                 pv_accum_dtype="fp32+fp16", smooth_k=True, smooth_v=False,
                                 return_lse=False, **kwargs):
    """The official sm89 kernel's signature; computed by SageAttention2-8b."""
    _check_choice("qk_quant_gran", qk_quant_gran, _GRANS)
    _check_choice("pv_accum_dtype", pv_accum_dtype, _ACCUMS["sageattn_qk_int8_pv_fp8_cuda"])
    return _run("sageattn_qk_int8_pv_fp8_cuda", q, k, v, tensor_layout, is_causal, sm_scale,
                return_lse, smooth_k, smooth_v, kwargs)


def sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="HND", is_causal=False,
                                      qk_quant_gran="per_thread", sm_scale=None,
                                      pv_accum_dtype="fp32+fp32", smooth_k=True,
                                      return_lse=False, **kwargs):
    """The official sm90 kernel's signature; computed by SageAttention2-8b."""
    _check_choice("qk_quant_gran", qk_quant_gran, _GRANS)
    _check_choice("pv_accum_dtype", pv_accum_dtype,
                  _ACCUMS["sageattn_qk_int8_pv_fp8_cuda_sm90"])
    return _run("sageattn_qk_int8_pv_fp8_cuda_sm90", q, k, v, tensor_layout, is_causal,
                sm_scale, return_lse, smooth_k, None, kwargs)


def sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    is_causal=False, sm_scale=None, smooth_k=True, **kwargs):
    """The official packed variable-length call: q [total_q, Hq, D], k/v [total_k, Hkv, D],
    cu_seqlens int32 or int64 [batch + 1]; returns o. Unlike the official package (one K mean
    over the whole packed batch), each sequence is smoothed and quantized on its own."""
    for name in kwargs:
        raise TypeError(f"sageattn_varlen() got an unexpected keyword argument {name!r}")
    cu = []
    for name, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if isinstance(c, torch.Tensor) and c.dtype == torch.int64:
            c = c.to(torch.int32)  # (a new tensor: the caller's stays as it is)
        cu.append(c)
    return _t.sageattn_varlen(q, k, v, cu[0], cu[1], max_seqlen_q, max_seqlen_k,
                              is_causal=is_causal, sm_scale=sm_scale, smooth_k=smooth_k)


__all__ = ["sageattn", "sageattn_varlen", "sageattn_qk_int8_pv_fp16_triton",
           "sageattn_qk_int8_pv_fp16_cuda", "sageattn_qk_int8_pv_fp8_cuda",
           "sageattn_qk_int8_pv_fp8_cuda_sm90"]
