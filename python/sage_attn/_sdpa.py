"""torch's SDPA running sage: a scoped switch for every torch, and a flash-attention impl
registered with torch.nn.attention where torch has that registry.

`sdpa()` swaps torch.nn.functional.scaled_dot_product_attention for the drop-in for the length of
a `with` block. `register_flash_impl()` (run on `import sage_attn`) makes "sage" one of
torch.nn.attention.list_flash_attention_impls(); `activate_flash_attention_impl("sage")` then
points SDPA's flash kernel (aten::_scaled_dot_product_flash_attention and its backward, CUDA) at
sage. Both keep the drop-in's routing: sage runs a call only where the library has a kernel for it
and its crossover model does not say torch's SDPA is faster on this GPU; every other call runs
what it ran before (the drop-in: torch's SDPA; the flash impl: torch's own flash kernel, fetched
with torch.library.get_kernel before sage takes its place).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from . import _lib
from . import _torch as _t

IMPL_NAME = "sage"


@contextlib.contextmanager
def sdpa():
    """`with sage_attn.sdpa(): model(x)` runs the model's torch.nn.functional.
    scaled_dot_product_attention calls through sage_attn.scaled_dot_product_attention (the drop-in:
    sage where it has a kernel and is faster, torch's SDPA elsewhere), and puts back whatever
    was there on exit, exceptions included. Nested blocks restore in order.

    The switch replaces a module attribute, so it is process-wide while the block runs: other
    threads calling F.scaled_dot_product_attention meanwhile get the drop-in too, and blocks
    entered from several threads at once may restore out of order. Code that bound the function
    before the block (`from torch.nn.functional import scaled_dot_product_attention`) keeps the
    original; torch.compile'd graphs traced before the block keep what they traced."""
    with swapped(_t.scaled_dot_product_attention):
        yield


@contextlib.contextmanager
def swapped(fn):
    """F.scaled_dot_product_attention replaced by fn for the block, whatever was there put back
    on exit (exceptions included); yields the function replaced, which fn may call for the calls
    it does not take. The mechanism of sdpa(), shared with sage_attn.mix (same caveats)."""
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fn
    try:
        yield saved
    finally:
        F.scaled_dot_product_attention = saved


# ---- torch.nn.attention's flash-attention registry ----

_FWD_OP = "aten::_scaled_dot_product_flash_attention"
_BWD_OP = "aten::_scaled_dot_product_flash_attention_backward"


def flash_registry_available() -> bool:
    """Whether this torch has the flash-attention registry (torch.nn.attention.
    register_flash_attention_impl) and torch.library.get_kernel, which the fallback to torch's
    own flash kernel needs."""
    attn = getattr(torch.nn, "attention", None)
    return (attn is not None and hasattr(attn, "register_flash_attention_impl")
            and hasattr(attn, "activate_flash_attention_impl")
            and hasattr(torch.library, "get_kernel"))


class _Handle:
    """What torch's registry keeps while "sage" is active; remove() puts torch's kernels back."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None
        _state.fwd = _state.bwd = None


class _State:
    fwd = None  # torch's own CUDA kernels, called for the calls sage does not take
    bwd = None


_state = _State()


def _layout_of(query):
    """The layout in which the query's memory is contiguous-like: NHD when its token stride
    exceeds its head stride (the [B,N,H,D] memory of a projection reshaped and transposed), else
    HND. The output sage allocates in that layout then has the query's dimension order, as the
    op's meta function says it must."""
    return _lib.LAYOUT_NHD if query.stride(2) > query.stride(1) else _lib.LAYOUT_HND


def _to(layout, *xs):
    return xs if layout == _lib.LAYOUT_HND else tuple(x.transpose(1, 2) for x in xs)


def _matching(x, ref):
    """x with the strides torch.empty_like(ref) would have (copied only where they differ)."""
    want = torch.empty_like(ref)
    if want.stride() != x.stride():
        want.copy_(x)
        return want
    return x


def _route(query, key, value, dropout_p, is_causal, scale, training):
    """(mask, scale) where sage takes this flash call, else None."""
    if dropout_p != 0.0:
        return None
    if not (query.is_cuda and key.is_cuda and value.is_cuda) and not _cpu_for_tests:
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    if query.dtype not in _t._GPU_DTYPES and not (_cpu_for_tests and not query.is_cuda):
        return None
    if not (query.dtype == key.dtype == value.dtype and query.device == key.device == value.device):
        return None
    if key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        return None
    hq, hkv = query.shape[1], key.shape[1]
    if hkv == 0 or hq % hkv != 0 or min(query.shape[2], key.shape[2], query.shape[0]) == 0:
        return None
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if not (s > 0 and math.isfinite(s)):
        return None
    # FlashAttention's causal mask is bottom-right aligned (SDPA sends it square causal calls
    # only, where both alignments agree; direct callers of the op get flash's meaning).
    mask = _lib.MASK_CAUSAL_BOTTOM_RIGHT if is_causal else _lib.MASK_NONE
    if query.is_cuda:
        # Shorter than the GPU's least routed length (learned from its first plan): torch's, as
        # the route below would answer, without planning (the drop-in's shortcut, _torch.py).
        if _t._shorter_than_routed(query.shape, query.device):
            return None
        if _t._dropin_route(query, key, value, mask, s, training) is not None:
            return None
    return mask, s


# CPU tensors never reach the CUDA registration; tests set this to run the kernels' Python
# bodies on CPU tensors (the CPU reference) and check their contract without a GPU.
_cpu_for_tests = False


def _flash_forward(keyset, query, key, value, dropout_p=0.0, is_causal=False,
                   return_debug_mask=False, *, scale=None):
    training = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or
                                            value.requires_grad)
    route = None if return_debug_mask else _route(query, key, value, dropout_p, is_causal, scale,
                                                  training)
    if route is None:
        return _state.fwd.call_boxed(keyset, query, key, value, dropout_p, is_causal,
                                     return_debug_mask, scale=scale)
    mask, s = route
    layout = _layout_of(query)
    q, k, v = _to(layout, query, key, value)
    o, lse = _t._attention(_t._Call(q, k, v, layout, mask, s, None, None, None, None,
                                    return_lse=True, fallback=_t._RAISE,
                                    family=_lib.KERNEL_AUTO))
    (o,) = _to(layout, o)
    o = _matching(o, query)
    # No dropout: the RNG state is never read; its shapes and dtypes are the op's.
    seed = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty((0,), dtype=query.dtype, device=query.device)
    return o, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug


def _flash_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                    max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                    scale=None):
    # The forward ran sage exactly where this route says so with training=True (the same rule
    # on the same shapes), so the backward follows its forward: SageBwd after sage, torch's
    # flash backward after torch's flash forward. (Toggling set_dropin_crossover between a
    # forward and its backward breaks that pairing.)
    route = _route(query, key, value, dropout_p, is_causal, scale, True)
    if route is None:
        return _state.bwd.call_boxed(keyset, grad_out, query, key, value, out, logsumexp,
                                     cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                     philox_seed, philox_offset, scale=scale)
    mask, s = route
    layout = _layout_of(query)
    q, k, v, d_o = _to(layout, query, key, value, grad_out)
    grads = _t._sage_backward(_t._backward, q, k, v, d_o, None, layout, mask, s)
    if grads is None:
        # SageBwd refused its own INT8 scores for this call (or keeps refusing its kind): the
        # gradients of torch's 16-bit flash attention instead (its forward recomputed, for the
        # O and LSE its backward reads).
        if query.is_cuda:
            fwd = _state.fwd.call_boxed(keyset, query, key, value, 0.0, is_causal, False,
                                        scale=scale)
            return _state.bwd.call_boxed(keyset, grad_out, query, key, value, fwd[0], fwd[1],
                                         cum_seq_q, cum_seq_k, max_q, max_k, 0.0, is_causal,
                                         fwd[6], fwd[7], scale=scale)
        grads = _t._backward_16bit(q, k, v, d_o, None, layout, mask, s)
    dq, dk, dv = _to(layout, *grads)
    return _matching(dq, query), _matching(dk, key), _matching(dv, value)


def _activate():
    """register_fn of torch's registry: sage's kernels in place of torch's flash kernels (CUDA),
    torch's kept for every call sage does not take."""
    _state.fwd = torch.library.get_kernel(_FWD_OP, "CUDA")
    _state.bwd = torch.library.get_kernel(_BWD_OP, "CUDA")
    lib = torch.library.Library("aten", "IMPL", "CUDA")  # noqa: TOR901 (an override by design)
    lib.impl("_scaled_dot_product_flash_attention", _flash_forward, "CUDA", with_keyset=True)
    lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CUDA",
             with_keyset=True)
    return _Handle(lib)


def register_flash_impl() -> bool:
    """Registers "sage" with torch.nn.attention.register_flash_attention_impl, where torch has
    the registry (see flash_registry_available); activating it stays the user's choice:
    `torch.nn.attention.activate_flash_attention_impl("sage")` (restore_flash_attention_impl()
    undoes it). Then SDPA calls that torch routes to its flash kernel run sage where the
    drop-in would (forward, and SageBwd for training calls where the library's table has sage's
    backward faster), and torch's flash kernel everywhere else. varlen_attn is not taken over.
    Returns whether "sage" is registered."""
    if not flash_registry_available():
        return False
    torch.nn.attention.register_flash_attention_impl(IMPL_NAME, register_fn=_activate)
    return True
