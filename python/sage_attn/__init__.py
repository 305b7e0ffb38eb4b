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
`sage_attn.parallel`. Integrations: `with sage_attn.sdpa():` (SDPA swapped for the drop-in in a
block), torch.nn.attention.activate_flash_attention_impl("sage") where torch has that registry,
`import sage_attn.transformers` (attn_implementation="sage"), and
`sage_attn.install_sageattention_alias()` (`import sageattention` for diffusers and ComfyUI).
SageAttn-mix (per call site 4/8-bit or sage/SDPA from a calibration): `sage_attn.mix`.
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
                         scaled_dot_product_attention, set_backward_retry,
                         set_dropin_crossover)
    from ._sdpa import sdpa  # noqa: F401
    from ._sdpa import register_flash_impl as _register_flash_impl
    # "sage" joins torch.nn.attention.list_flash_attention_impls() where torch has the
    # registry; it runs only after torch.nn.attention.activate_flash_attention_impl("sage").
    _register_flash_impl()

if _torch_missing:
    def _needs_torch(*_args, **_kwargs):
        raise ImportError("sage_attn.sageattn, sageattn3, sageattn_varlen and "
                          "scaled_dot_product_attention "
                          "need PyTorch; sage_attn.attention_numpy and attention_varlen_numpy "
                          "work without it")

    sageattn = sageattn3 = sageattn_varlen = scaled_dot_product_attention = _needs_torch
    dropin_backend = set_dropin_crossover = backward_fallbacks = sdpa = _needs_torch
    set_backward_retry = _needs_torch


def install_sageattention_alias() -> None:
    """Opt-in: `import sageattention` gives sage_attn.sageattention (the official package's
    functions, computed by this library) for this process; see sage_attn._alias."""
    from ._alias import install_sageattention_alias as install
    install()


__all__ = ["sageattn", "sageattn3", "sageattn_varlen", "scaled_dot_product_attention", "sdpa",
           "install_sageattention_alias", "dropin_backend",
           "set_dropin_crossover", "backward_fallbacks", "set_backward_retry",
           "SageBwdFallbackWarning", "attention_numpy", "attention_varlen_numpy", "metrics",
           "version",
           "SageError", "SageArgumentError", "SageUnsupportedError"]
