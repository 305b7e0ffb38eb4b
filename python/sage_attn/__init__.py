"""sage_attn: SageAttention2 quantized attention (libsage) for PyTorch and numpy.

    from sage_attn import sageattn
    o = sageattn(q, k, v, is_causal=True)                    # fp16/bf16 CUDA tensors, [B,H,N,D]

    import torch.nn.functional as F, sage_attn
    F.scaled_dot_product_attention = sage_attn.scaled_dot_product_attention   # drop-in

The library is reached through its C API (ctypes); torch is needed only for the torch functions.
`sage_attn.attention_numpy` runs the CPU reference on numpy arrays (no torch, no GPU).
Packed variable-length batches: `sageattn_varlen` (flash_attn_varlen_func's conventions; CUDA
tensors on the GPU kernels, CPU tensors on the CPU reference) and `attention_varlen_numpy`.
Context parallelism (Ulysses, ring attention, the LSE merge) on torch.distributed:
`sage_attn.parallel`.
"""
from ._lib import (SageArgumentError, SageBwdFallbackWarning, SageError,  # noqa: F401
                   SageUnsupportedError, version)

__version__ = "0.1.0"

try:
    from ._numpy import attention as attention_numpy  # noqa: F401
    from ._numpy import attention_varlen as attention_varlen_numpy  # noqa: F401
    from ._numpy import metrics  # noqa: F401
except ImportError:  # numpy missing: the torch functions still work
    pass

try:
    import torch  # noqa: F401
except ImportError:
    _torch_missing = True
else:
    _torch_missing = False
    from ._torch import (backward_fallbacks,  # noqa: F401
                         dropin_backend, sageattn, sageattn3, sageattn_varlen,
                         scaled_dot_product_attention, set_dropin_crossover)

if _torch_missing:
    def _needs_torch(*_args, **_kwargs):
        raise ImportError("sage_attn.sageattn, sageattn3, sageattn_varlen and "
                          "scaled_dot_product_attention "
                          "need PyTorch; sage_attn.attention_numpy and attention_varlen_numpy "
                          "work without it")

    sageattn = sageattn3 = sageattn_varlen = scaled_dot_product_attention = _needs_torch
    dropin_backend = set_dropin_crossover = backward_fallbacks = _needs_torch

__all__ = ["sageattn", "sageattn3", "sageattn_varlen", "scaled_dot_product_attention", "dropin_backend",
           "set_dropin_crossover", "backward_fallbacks", "SageBwdFallbackWarning", "attention_numpy", "attention_varlen_numpy", "metrics",
           "version",
           "SageError", "SageArgumentError", "SageUnsupportedError"]
