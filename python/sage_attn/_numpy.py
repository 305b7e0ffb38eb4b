"""numpy front end: the CPU reference (exact emulation of each kernel, or float64 attention) on
host arrays. Needs no torch and no GPU; the accuracy tool and the CI tests of the ctypes layer use
it. Slow by design: it is the oracle, not the fast path."""
from __future__ import annotations

import numpy as np

from . import _lib

_DTYPES = {np.dtype(np.float16): _lib.DTYPE_FP16, np.dtype(np.float32): _lib.DTYPE_FP32}


def _host_array(x, name, ndim=4, shape_text="[B,H,N,D] or [B,N,H,D]"):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; pass float16 or float32")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions ({shape_text}), got shape "
                         f"{tuple(x.shape)}")
    item = x.itemsize
    if x.strides[-1] != item or any(s < 0 or s % item for s in x.strides):
        x = np.ascontiguousarray(x)  # the library reads rows with a unit last stride
    return x


def attention(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, *,
              qk_bits=None, smooth_k=None, smooth_q=None, smooth_v=None,
              causal_align="bottom_right", exact=False, num_threads=0, quant=None):
    """Attention of numpy arrays on the CPU reference.

    exact=True gives float64 attention of the (fp16/fp32) inputs (not with qk_bits or the
    smoothing flags, which choose a quantization); otherwise the bit-faithful
    emulation of the SageAttn2 kernel chosen by qk_bits and the smoothing flags (None = preset).
    quant, a _lib.QuantConfig (for example _lib.preset(_lib.VARIANT_SAGE3_FP4), SageAttention3's
    FP4 attention), runs that config as given instead (SAGE_VARIANT_CUSTOM; not with qk_bits,
    the smoothing flags or exact).
    Returns o (q's dtype and shape, contiguous), and lse ([B, Hq, Nq] float32, natural log) when
    return_lse is True."""
    if tensor_layout not in _lib.LAYOUTS:
        raise ValueError(f"tensor_layout = {tensor_layout!r}: must be 'HND' or 'NHD'")
    _lib.check_call_flags(causal_align, is_causal, return_lse)
    q, k, v = _host_array(q, "q"), _host_array(k, "k"), _host_array(v, "v")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    layout = _lib.LAYOUTS[tensor_layout]
    hi, ni = (1, 2) if layout == _lib.LAYOUT_HND else (2, 1)
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k: shape {tuple(k.shape)} must have q's batch and head_dim "
                         f"(q is {tuple(q.shape)})")
    if quant is None:
        variant, cfg = _lib.quant_settings(qk_bits, smooth_q, smooth_k, smooth_v, exact)
    else:
        if not isinstance(quant, _lib.QuantConfig):
            raise TypeError(f"quant: expected a sage_attn._lib.QuantConfig, got "
                            f"{type(quant).__name__}")
        given = [name for name, value in (("qk_bits", qk_bits), ("smooth_q", smooth_q),
                                          ("smooth_k", smooth_k), ("smooth_v", smooth_v))
                 if value is not None] + (["exact"] if exact else [])
        if given:
            raise ValueError(f"quant: a full config; {', '.join(given)} cannot be given with it")
        variant, cfg = _lib.VARIANT_CUSTOM, quant
    o = np.empty(q.shape, dtype=q.dtype)
    B, Hq, Nq, D = q.shape[0], q.shape[hi], q.shape[ni], q.shape[3]
    lse = np.empty((B, Hq, Nq), dtype=np.float32) if return_lse else None

    a = _lib.new_args()
    a.q, a.k, a.v, a.o = q.ctypes.data, k.ctypes.data, v.ctypes.data, o.ctypes.data
    a.lse = lse.ctypes.data if lse is not None else None
    a.batch, a.heads_q, a.heads_kv = B, Hq, k.shape[hi]
    a.seq_q, a.seq_kv, a.head_dim = Nq, k.shape[ni], D
    a.layout = layout
    for field, x in (("q_strides", q), ("k_strides", k), ("v_strides", v), ("o_strides", o)):
        _lib.set_strides(getattr(a, field), layout, [s // x.itemsize for s in x.strides])
    _run_cpu(a, q.dtype, sm_scale, is_causal, causal_align, variant, cfg, num_threads)
    return (o, lse) if return_lse else o


def _run_cpu(a, dtype, sm_scale, is_causal, causal_align, variant, cfg, num_threads):
    """The settings both entry points share, then the CPU reference call on `a`."""
    a.dtype = _DTYPES[dtype]
    a.scale = 0.0 if sm_scale is None else float(sm_scale)
    if sm_scale is not None and not a.scale > 0:
        raise ValueError(f"sm_scale = {sm_scale!r}: must be a positive number or None")
    a.mask = _lib.CAUSAL_ALIGNS[causal_align] if is_causal else _lib.MASK_NONE
    a.variant, a.quant = variant, cfg
    a.backend = _lib.BACKEND_CPU
    a.num_threads = int(num_threads)
    _lib.run(a)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     is_causal=False, sm_scale=None, return_lse=False, *, qk_bits=None,
                     smooth_k=None, smooth_q=None, smooth_v=None, causal_align="bottom_right",
                     exact=False, num_threads=0):
    """Attention of a packed variable-length batch on the CPU reference (flash_attn_varlen_func's
    conventions): q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens_q/k int32 [batch + 1]
    cumulative lengths, max_seqlen_q/k the longest sequence's lengths. Each sequence is its own
    problem (causal alignment, smoothing means and quantization groups stay inside it).
    Returns o (q's shape and dtype), and lse [Hq, total_q] float32 when return_lse is True; a
    sequence with queries but no keys gives o = 0 and lse = -inf."""
    _lib.check_call_flags(causal_align, is_causal, return_lse)
    q, k, v = (_host_array(x, name, 3, "[total_tokens, H, D]")
               for name, x in (("q", q), ("k", k), ("v", v)))
    _lib.check_packed_qkv(q, k, v)
    cus = []
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, np.ndarray) or cu.dtype != np.int32 or cu.ndim != 1:
            raise TypeError(f"{name}: expected a 1-D numpy int32 array (batch + 1 cumulative "
                            f"lengths), got {getattr(cu, 'dtype', type(cu).__name__)}")
        cus.append(np.ascontiguousarray(cu))
    cu_q, cu_k = cus
    _lib.check_cu_seqlens_counts(cu_q.shape[0], cu_k.shape[0])
    variant, cfg = _lib.quant_settings(qk_bits, smooth_q, smooth_k, smooth_v, exact)
    o = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty((q.shape[1], q.shape[0]), dtype=np.float32) if return_lse else None

    a = _lib.new_args()
    a.q, a.k, a.v, a.o = q.ctypes.data, k.ctypes.data, v.ctypes.data, o.ctypes.data
    a.lse = lse.ctypes.data if lse is not None else None
    _lib.set_packed(a, q.shape, k.shape, cu_q.ctypes.data, cu_k.ctypes.data, cu_q.shape[0] - 1,
                    max_seqlen_q, max_seqlen_k,
                    {f: (x.strides[0] // x.itemsize, x.strides[1] // x.itemsize)
                     for f, x in (("q_strides", q), ("k_strides", k), ("v_strides", v),
                                  ("o_strides", o))})
    _run_cpu(a, q.dtype, sm_scale, is_causal, causal_align, variant, cfg, num_threads)
    return (o, lse) if return_lse else o


def metrics(out, ref):
    """The four accuracy metrics of the SageAttention2 paper (float64): cos, rel_l1, rmse,
    max_abs."""
    o = np.asarray(out, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    d = o - r
    denom = np.sqrt((o * o).sum()) * np.sqrt((r * r).sum())
    return {
        "cos": float((o * r).sum() / denom) if denom > 0 else float(np.array_equal(o, r)),
        "rel_l1": float(np.abs(d).sum() / max(np.abs(r).sum(), 1e-300)),
        "rmse": float(np.sqrt((d * d).mean())),
        "max_abs": float(np.abs(d).max()) if d.size else 0.0,
    }
