"""ctypes binding of libsage's C API (include/sage/sage.h): structs, enums, loading, errors.

No torch and no numpy here: the front ends (_torch.py, _numpy.py) hand in raw pointers, sizes and
strides in elements. Every call goes through `run()`, which maps a failing status to a Python
exception carrying the library's message (it names the argument and its value).
"""
from __future__ import annotations

import ctypes
import numbers
import os
import pathlib
import threading

# --- enums (values as in sage.h) -----------------------------------------------------------------
OK, INVALID_ARGUMENT, UNSUPPORTED, CUDA_ERROR, OUT_OF_MEMORY, WORKSPACE_TOO_SMALL, INTERNAL = range(7)
DTYPE_FP16, DTYPE_BF16, DTYPE_FP32 = 0, 1, 2
LAYOUT_HND, LAYOUT_NHD = 0, 1
MASK_NONE, MASK_CAUSAL_BOTTOM_RIGHT, MASK_CAUSAL_TOP_LEFT = 0, 1, 2
BACKEND_AUTO, BACKEND_CPU, BACKEND_CUDA = 0, 1, 2
VARIANT_AUTO, VARIANT_SAGE2_8B, VARIANT_SAGE2_4B, VARIANT_EXACT, VARIANT_CUSTOM, VARIANT_SAGE3_FP4 = \
    range(6)
QK_NONE, QK_INT8, QK_INT4, QK_FP8_E4M3, QK_NVFP4, QK_MXFP4 = range(6)
PV_NONE, PV_FP16, PV_FP8_E4M3, PV_FP8_E5M2, PV_INT8, PV_NVFP4, PV_NVFP4_DIRECT, PV_MXFP4 = range(8)
GRANULARITY_PER_THREAD_MMA, GRANULARITY_PER_THREAD_WGMMA, GRANULARITY_PER_TOKEN, \
    GRANULARITY_PER_WARP, GRANULARITY_PER_BLOCK, GRANULARITY_PER_TENSOR = range(6)
V_SCALE_PER_CHANNEL, V_SCALE_PER_BLOCK_CHANNEL, V_SCALE_PER_BLOCK = range(3)
PV_ACCUM_FP32, PV_ACCUM_HW, PV_ACCUM_TWO_LEVEL, PV_ACCUM_ALIGNED = range(4)
KERNEL_AUTO, KERNEL_MMA, KERNEL_SM90, KERNEL_FP4 = range(4)
OPTION_PREPASS_Q, OPTION_PREPASS_KV_SPLIT, OPTION_WHOLE_TILES, OPTION_PREPASS_KV_BLOCKS = 1, 2, 4, 8
SMOOTH_Q, SMOOTH_K, SMOOTH_V = 1, 2, 4
BWD_INT8_QK, BWD_INT8_PDO, BWD_INT8_DOV, BWD_INT8_DSK, BWD_INT8_DSQ = 1, 2, 4, 8, 16
BWD_INT8_DEFAULT = BWD_INT8_QK | BWD_INT8_PDO | BWD_INT8_DSK | BWD_INT8_DSQ
BWD_MAX_SCORE_ERROR = 0.04
BWD_MAX_GRAD_ERROR = 1e-3
BWD_OPTION_DETERMINISTIC = 1
BWD_NORM_OWN, BWD_NORM_FORWARD = 0, 1
# (tests/python/test_abi.py holds every constant here to sage.h's value, compiled.)

LAYOUTS = {"HND": LAYOUT_HND, "NHD": LAYOUT_NHD}
CAUSAL_ALIGNS = {"bottom_right": MASK_CAUSAL_BOTTOM_RIGHT, "top_left": MASK_CAUSAL_TOP_LEFT}


class SageError(RuntimeError):
    """A libsage call failed for a reason that is not the caller's argument (CUDA, memory)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class SageArgumentError(SageError, ValueError):
    """An argument is wrong (INVALID_ARGUMENT) or has no kernel (UNSUPPORTED): a ValueError."""


class SageUnsupportedError(SageArgumentError):
    """Valid arguments that no kernel/backend implements (e.g. head_dim 256 on the GPU)."""


class SageBwdFallbackWarning(UserWarning):
    """A backward that SageBwd's accuracy check sent to 16 bits (torch): its INT8 scores were
    estimated too coarse for gradients it could stand behind (docs/backward.md)."""


# --- structs: field names, order and types exactly as sage.h (tests/python/test_abi.py checks
# them field by field against the header's text and the compiler's offsets and sizes; the
# library's struct_size against ours at load) ------------------------------------------------
class QuantConfig(ctypes.Structure):
    _fields_ = [
        ("qk_format", ctypes.c_int),
        ("granularity", ctypes.c_int),
        ("smooth", ctypes.c_uint32),
        ("pv_format", ctypes.c_int),
        ("v_scale", ctypes.c_int),
        ("pv_accum", ctypes.c_int),
        ("pv_flush_interval", ctypes.c_int32),
        ("accum_mantissa_bits", ctypes.c_int32),
        ("accum_chunk", ctypes.c_int32),
        ("block_q", ctypes.c_int32),
        ("block_k", ctypes.c_int32),
        ("warps", ctypes.c_int32),
        ("k_mean_tokens", ctypes.c_int32),
        ("softmax_block_k", ctypes.c_int32),
        ("exp2_poly_every", ctypes.c_int32),
        ("split_tiles", ctypes.c_int32),
        ("split_ctas", ctypes.c_int32),
    ]


class Strides(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("head", ctypes.c_int64), ("token", ctypes.c_int64)]


class AttentionArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("batch", ctypes.c_int64),
        ("heads_q", ctypes.c_int64),
        ("heads_kv", ctypes.c_int64),
        ("seq_q", ctypes.c_int64),
        ("seq_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("layout", ctypes.c_int),
        ("q_strides", Strides),
        ("k_strides", Strides),
        ("v_strides", Strides),
        ("o_strides", Strides),
        ("lse_strides", Strides),
        ("dtype", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("mask", ctypes.c_int),
        ("variant", ctypes.c_int),
        ("quant", QuantConfig),
        ("backend", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_size", ctypes.c_size_t),
        ("num_threads", ctypes.c_int32),
        ("kernel", ctypes.c_int),
        ("options", ctypes.c_uint32),
        ("cu_seqlens_q", ctypes.c_void_p),
        ("cu_seqlens_k", ctypes.c_void_p),
        ("total_q", ctypes.c_int64),
        ("total_k", ctypes.c_int64),
    ]


class BackwardConfig(ctypes.Structure):
    _fields_ = [
        ("int8", ctypes.c_uint32),
        ("smooth", ctypes.c_uint32),
        ("block_q", ctypes.c_int32),
        ("block_k", ctypes.c_int32),
        ("granularity", ctypes.c_int),
        ("channel_scales", ctypes.c_uint32),
        ("normalizer", ctypes.c_uint32),
    ]


class BackwardArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("d_o", ctypes.c_void_p),
        ("d_lse", ctypes.c_void_p),
        ("dq", ctypes.c_void_p),
        ("dk", ctypes.c_void_p),
        ("dv", ctypes.c_void_p),
        ("batch", ctypes.c_int64),
        ("heads_q", ctypes.c_int64),
        ("heads_kv", ctypes.c_int64),
        ("seq_q", ctypes.c_int64),
        ("seq_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("layout", ctypes.c_int),
        ("q_strides", Strides),
        ("k_strides", Strides),
        ("v_strides", Strides),
        ("o_strides", Strides),
        ("lse_strides", Strides),
        ("do_strides", Strides),
        ("dlse_strides", Strides),
        ("dq_strides", Strides),
        ("dk_strides", Strides),
        ("dv_strides", Strides),
        ("dtype", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("mask", ctypes.c_int),
        ("variant", ctypes.c_int),
        ("config", BackwardConfig),
        ("backend", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_size", ctypes.c_size_t),
        ("num_threads", ctypes.c_int32),
        ("options", ctypes.c_uint32),
        ("kernel", ctypes.c_int),
        ("untrusted", ctypes.c_void_p),
    ]


class PlanInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", ctypes.c_int),
        ("kernel", ctypes.c_int),
        ("block_q", ctypes.c_int32),
        ("block_k", ctypes.c_int32),
        ("fused_q", ctypes.c_int32),
        ("launches", ctypes.c_int32),
        ("prefer_sdpa", ctypes.c_int32),
        ("workspace_size", ctypes.c_size_t),
        ("emulation", QuantConfig),
        ("kernel_head_dim", ctypes.c_int64),
        ("has_backward", ctypes.c_int32),
        ("prefer_sdpa_training", ctypes.c_int32),
        ("sdpa_below", ctypes.c_int64),
    ]


# --- loading ---------------------------------------------------------------------------------------
_lock = threading.Lock()
_lib = None
_args_template = None
_bwd_template = None
_presets: dict[int, bytes] = {}


def _candidates():
    env = os.environ.get("SAGE_LIBRARY")
    if env:
        yield pathlib.Path(env)
        return
    here = pathlib.Path(__file__).resolve().parent
    yield here / "libsage.so"  # installed by `pip install .`
    root = here.parent.parent  # a source checkout: python/sage_attn -> repository root
    for build in ("build", "build-gpu"):
        yield root / build / "libsage.so"


def library() -> ctypes.CDLL:
    """The loaded libsage (SAGE_LIBRARY, the package directory, or a source checkout's build/)."""
    global _lib, _args_template, _bwd_template
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            tried.append(str(path))
            if path.is_file():
                lib = ctypes.CDLL(str(path))
                break
        else:
            raise ImportError("libsage not found (tried: " + ", ".join(tried) + "); build it with "
                              "scripts/build or `pip install .`, or set SAGE_LIBRARY")
        lib.sage_version.restype = ctypes.c_char_p
        lib.sage_last_error.restype = ctypes.c_char_p
        lib.sage_status_string.restype = ctypes.c_char_p
        lib.sage_status_string.argtypes = [ctypes.c_int]
        lib.sage_attention_args_init.argtypes = [ctypes.POINTER(AttentionArgs)]
        lib.sage_quant_config_init.argtypes = [ctypes.POINTER(QuantConfig), ctypes.c_int]
        lib.sage_attention_workspace_size.argtypes = [ctypes.POINTER(AttentionArgs),
                                                      ctypes.POINTER(ctypes.c_size_t)]
        lib.sage_attention.argtypes = [ctypes.POINTER(AttentionArgs)]
        lib.sage_attention_plan.argtypes = [ctypes.POINTER(AttentionArgs), ctypes.POINTER(PlanInfo)]
        lib.sage_backward_args_init.argtypes = [ctypes.POINTER(BackwardArgs)]
        lib.sage_backward_workspace_size.argtypes = [ctypes.POINTER(BackwardArgs),
                                                     ctypes.POINTER(ctypes.c_size_t)]
        lib.sage_attention_backward.argtypes = [ctypes.POINTER(BackwardArgs)]
        for f in ("sage_attention_args_init", "sage_quant_config_init",
                  "sage_attention_workspace_size", "sage_attention", "sage_attention_plan",
                  "sage_backward_args_init", "sage_backward_workspace_size",
                  "sage_attention_backward"):
            getattr(lib, f).restype = ctypes.c_int
        template = AttentionArgs()
        status = lib.sage_attention_args_init(ctypes.byref(template))
        if status != OK or template.struct_size != ctypes.sizeof(AttentionArgs):
            raise ImportError(f"{path}: sage_attention_args is {template.struct_size} bytes in the "
                              f"library, {ctypes.sizeof(AttentionArgs)} in this binding: the "
                              "library and the Python package come from different versions")
        _args_template = bytes(template)
        btemplate = BackwardArgs()
        status = lib.sage_backward_args_init(ctypes.byref(btemplate))
        if status != OK or btemplate.struct_size != ctypes.sizeof(BackwardArgs):
            raise ImportError(f"{path}: sage_backward_args is {btemplate.struct_size} bytes in "
                              f"the library, {ctypes.sizeof(BackwardArgs)} in this binding: the "
                              "library and the Python package come from different versions")
        _bwd_template = bytes(btemplate)
        _lib = lib
        return lib


def version() -> str:
    return library().sage_version().decode()


def _raise(status: int, what: str):
    lib = library()
    msg = lib.sage_last_error().decode(errors="replace") or lib.sage_status_string(status).decode()
    msg = f"{what}: {msg}" if what else msg
    if status == UNSUPPORTED:
        raise SageUnsupportedError(status, msg)
    if status == INVALID_ARGUMENT:
        raise SageArgumentError(status, msg)
    if status == OUT_OF_MEMORY:
        raise MemoryError(msg)
    raise SageError(status, msg)


def preset(variant: int) -> QuantConfig:
    """The quantization config of a preset (sage_quant_config_init)."""
    lib = library()
    if variant not in _presets:
        cfg = QuantConfig()
        status = lib.sage_quant_config_init(ctypes.byref(cfg), variant)
        if status != OK:
            _raise(status, "sage_quant_config_init")
        _presets[variant] = bytes(cfg)
    return QuantConfig.from_buffer_copy(_presets[variant])


def check_call_flags(causal_align, is_causal, return_lse):
    """The keywords every attention entry point shares: a known causal_align, and is_causal and
    return_lse as bools only (a mask array or a string passed as is_causal is a mistake, not
    "true")."""
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal_align = {causal_align!r}: must be 'bottom_right' or 'top_left'")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal = {is_causal!r}: must be a bool")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse = {return_lse!r}: must be a bool")


def check_packed_qkv(q, k, v):
    """Packed [total, H, D] q, k, v (numpy arrays or torch tensors) that fit together: one
    dtype, k and v of one shape, one head dim."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"k: head_dim {k.shape[2]} must equal q's {q.shape[2]}")


def check_cu_seqlens_counts(entries_q, entries_k):
    """cu_seqlens_q and cu_seqlens_k (numpy arrays or torch tensors) of one packed call: the
    same number of entries, batch + 1 >= 2."""
    if entries_q != entries_k or entries_q < 2:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: need the same batch + 1 >= 2 entries "
                         f"each (got {entries_q} and {entries_k})")


def check_flag(name, value):
    """A smoothing keyword: True, False or None (the preset); anything else is a TypeError."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} = {value!r}: must be True, False or None")


# The torch op's qk_bits for SageAttention3's FP4 preset (sageattn3; never a public value).
QK_BITS_FP4 = 0


def quant_settings(qk_bits, smooth_q, smooth_k, smooth_v, exact=False):
    """(variant, QuantConfig) for the Python keywords. None means: what the preset does.

    qk_bits 8 (or None) is SageAttn2-8b, 4 is SageAttn2-4b; the presets smooth K and V, and Q for
    4b. Smoothing V is on by default because it costs nothing in the kernel (delta_V is added in
    the epilogue) and cuts the error on V with a channel bias several-fold."""
    if exact:
        given = [name for name, value in (("qk_bits", qk_bits), ("smooth_q", smooth_q),
                                          ("smooth_k", smooth_k), ("smooth_v", smooth_v))
                 if value is not None]
        if given:  # (they choose a quantization, and exact has none: not silently dropped)
            raise ValueError(f"exact=True computes float64 attention, with no quantization: "
                             f"{', '.join(given)} cannot be given with it")
        return VARIANT_EXACT, preset(VARIANT_SAGE2_8B)
    if qk_bits == QK_BITS_FP4 and not isinstance(qk_bits, bool):  # sageattn3's internal code
        return VARIANT_SAGE3_FP4, preset(VARIANT_SAGE3_FP4)
    if qk_bits is None:
        qk_bits = 8
    if qk_bits not in (4, 8) or isinstance(qk_bits, bool):
        raise ValueError(f"qk_bits = {qk_bits!r}: must be 8 (INT8 Q·K, SageAttn2-8b), 4 (INT4, "
                         "SageAttn2-4b) or None (8)")
    base = VARIANT_SAGE2_8B if qk_bits == 8 else VARIANT_SAGE2_4B
    cfg = preset(base)
    flags = cfg.smooth
    for flag, value, name in ((SMOOTH_Q, smooth_q, "smooth_q"), (SMOOTH_K, smooth_k, "smooth_k"),
                              (SMOOTH_V, smooth_v, "smooth_v")):
        check_flag(name, value)
        if value is not None:
            flags = (flags | flag) if value else (flags & ~flag)
    if flags == cfg.smooth:
        return base, cfg
    cfg.smooth = flags
    return VARIANT_CUSTOM, cfg


def new_args() -> AttentionArgs:
    library()
    return AttentionArgs.from_buffer_copy(_args_template)


def new_backward_args() -> BackwardArgs:
    library()
    return BackwardArgs.from_buffer_copy(_bwd_template)


def backward_workspace_size(args: BackwardArgs) -> int:
    n = ctypes.c_size_t(0)
    status = library().sage_backward_workspace_size(ctypes.byref(args), ctypes.byref(n))
    if status != OK:
        _raise(status, "")
    return n.value


def run_backward(args: BackwardArgs):
    status = library().sage_attention_backward(ctypes.byref(args))
    if status != OK:
        _raise(status, "")


def set_strides(field: Strides, layout: int, strides4):
    """Element strides of a 4-D [B,H,N,D] (HND) or [B,N,H,D] (NHD) tensor into a sage_strides."""
    field.batch = strides4[0]
    if layout == LAYOUT_HND:
        field.head, field.token = strides4[1], strides4[2]
    else:
        field.token, field.head = strides4[1], strides4[2]


def set_packed(a: AttentionArgs, q_shape, k_shape, cu_q: int, cu_k: int, batch: int,
               max_seqlen_q: int, max_seqlen_k: int, strides: dict):
    """A packed variable-length batch (sage.h, cu_seqlens_*): q [total_q, Hq, D] and k/v
    [total_k, Hkv, D] token-major (layout NHD, no batch stride); cu_q, cu_k the addresses of the
    int32 [batch + 1] cumulative lengths; strides {field: (token, head)} in elements."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} = {value!r}: must be an int (the longest sequence's length)")
    a.layout = LAYOUT_NHD
    a.batch, a.heads_q, a.heads_kv, a.head_dim = batch, q_shape[1], k_shape[1], q_shape[2]
    a.seq_q, a.seq_kv = int(max_seqlen_q), int(max_seqlen_k)
    a.total_q, a.total_k = q_shape[0], k_shape[0]
    a.cu_seqlens_q, a.cu_seqlens_k = cu_q, cu_k
    for field, (token, head) in strides.items():
        s = getattr(a, field)
        s.batch, s.head, s.token = 0, head, token


def workspace_size(args: AttentionArgs) -> int:
    n = ctypes.c_size_t(0)
    status = library().sage_attention_workspace_size(ctypes.byref(args), ctypes.byref(n))
    if status != OK:
        _raise(status, "")
    return n.value


def plan(args: AttentionArgs) -> PlanInfo:
    """What sage_attention would run for these args (sage_attention_plan): validated once."""
    info = PlanInfo()
    info.struct_size = ctypes.sizeof(PlanInfo)
    status = library().sage_attention_plan(ctypes.byref(args), ctypes.byref(info))
    if status != OK:
        _raise(status, "")
    return info


def run(args: AttentionArgs):
    status = library().sage_attention(ctypes.byref(args))
    if status != OK:
        _raise(status, "")
