"""Context parallelism on torch.distributed: Ulysses and ring attention with sage as the local
kernel, and the exact LSE merge of partial attention outputs.

Each rank holds a shard of the sequence (all heads); the collectives are torch.distributed's
(NCCL between GPUs, gloo between CPU processes), over a process group (default: WORLD).

- ulysses_attention: an all-to-all turns "my tokens, every head" into "every token, my heads"
  (Hq and Hkv must divide by the world size), the local kernel runs the whole sequence for those
  heads, and a second all-to-all turns it back. Shards are contiguous, in rank order.
- ring_attention: K/V shards travel around the ring (batch_isend_irecv, the next block in flight
  while the local kernel runs on the current one); each block's partial output is merged into the
  running one through the LSEs. Causal ring attention takes the zig-zag layout (zigzag_shard):
  rank r holds sequence chunks r and 2W-1-r of 2W equal chunks, so every rank does the same work.
- merge_attention: o, lse of two disjoint key sets -> o, lse of their union, exactly.
"""
from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
import torch.distributed as dist

from . import _lib

__all__ = ["merge_attention", "ulysses_attention", "ring_attention", "zigzag_shard",
           "zigzag_unshard", "local_kernel"]


# --- the LSE merge -------------------------------------------------------------------------------
def _lse_like_o(lse, layout):
    # lse [B, H, N] broadcast against o: [B, H, N, 1] (HND) or [B, N, H, 1] (NHD).
    return (lse if layout == "HND" else lse.transpose(1, 2)).unsqueeze(-1)


def _merge_into(o_acc, lse_acc, o, lse, layout):
    """o_acc, lse_acc (float32/64, updated in place) <- the merge with the partial (o, lse).

    The max trick: with m = max(lse_acc, lse), w = exp(lse - m) <= 1 and the sum of the two
    weights is >= 1 unless both are -inf, so nothing overflows. A fully masked partial (lse -inf,
    o 0) has weight 0 and leaves the other side as it was; two of them give o 0, lse -inf. A NaN
    in either lse or o reaches the result (max, exp and the products all propagate it)."""
    m = torch.maximum(lse_acc, lse)
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)  # (-inf - -inf would be NaN)
    w_acc = torch.exp(lse_acc - m_safe)
    w_new = torch.exp(lse - m_safe)
    total = w_acc + w_new
    # o = (w_acc o_acc + w_new o) / total; a total of 0 (both masked) gives 0, NaN stays NaN.
    inv = torch.where(total == 0, torch.zeros_like(total), 1.0 / total)
    o_acc.mul_(_lse_like_o(w_acc * inv, layout))
    o_acc.add_(o.to(o_acc.dtype) * _lse_like_o(w_new * inv, layout))
    lse_acc.copy_(m_safe + torch.log(total))


def merge_attention(o1, lse1, o2, lse2, tensor_layout="HND"):
    """The attention output and LSE over the union of two disjoint key sets, from each set's
    output and LSE: o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), lse = log(e^lse1 + e^lse2),
    computed with the max trick (no overflow, exact up to rounding). o1, o2 [B,H,N,D] (HND) or
    [B,N,H,D] (NHD); lse1, lse2 [B,H,N], natural log (what sageattn(..., return_lse=True)
    gives). A fully masked partial (lse -inf, o 0) merges as nothing; NaN stays NaN. Computes in
    float64 when any input is float64, else float32; returns o in o1/o2's promoted dtype and lse
    in float32 (float64 if an lse was)."""
    if tensor_layout not in _lib.LAYOUTS:
        raise ValueError(f"tensor_layout = {tensor_layout!r}: must be 'HND' or 'NHD'")
    for name, x in (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if o1.shape != o2.shape:
        raise ValueError(f"o2: shape {tuple(o2.shape)} must equal o1's {tuple(o1.shape)}")
    if o1.dim() != 4:
        raise ValueError(f"o1: expected 4 dimensions, got shape {tuple(o1.shape)}")
    hi, ni = (1, 2) if tensor_layout == "HND" else (2, 1)
    want = (o1.shape[0], o1.shape[hi], o1.shape[ni])
    for name, x in (("lse1", lse1), ("lse2", lse2)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: shape {tuple(x.shape)} must be [B, H, N] = {want} for o "
                             f"of shape {tuple(o1.shape)} in {tensor_layout}")
    wide = any(x.dtype == torch.float64 for x in (o1, o2, lse1, lse2))
    acc = torch.float64 if wide else torch.float32
    o = o1.to(acc, copy=True)
    lse = lse1.to(acc, copy=True)
    _merge_into(o, lse, o2, lse2.to(acc), tensor_layout)
    lse_dtype = torch.float64 if torch.float64 in (lse1.dtype, lse2.dtype) else torch.float32
    return o.to(torch.promote_types(o1.dtype, o2.dtype)), lse.to(lse_dtype)


# --- local kernels -------------------------------------------------------------------------------
def _sage_kernel(**options):
    from ._torch import sageattn
    # Options the schemes do not set themselves, checked here rather than at the first call on
    # every rank: sageattn's keyword-only ones (qk_bits, the smoothing flags, causal_align,
    # kernel).
    known = [n for n, p in inspect.signature(sageattn).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"local='sage': unknown options {unknown} (sageattn takes "
                         f"{', '.join(known)})")

    def run(q, k, v, tensor_layout, is_causal, sm_scale):
        return sageattn(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                        sm_scale=sm_scale, return_lse=True, **options)
    return run


def _sdpa_kernel(**options):
    """torch's SDPA with its LSE (the aten ops behind F.scaled_dot_product_attention: flash on
    CUDA, the CPU flash kernel on CPU); GQA by repeating K/V heads, which those ops need."""
    if options:
        raise ValueError(f"local='sdpa' takes no options (got {sorted(options)})")

    def run(q, k, v, tensor_layout, is_causal, sm_scale):
        if tensor_layout == "NHD":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        if q.is_cuda:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal, False, scale=sm_scale)[:2]
        else:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal, scale=sm_scale)[:2]
        if tensor_layout == "NHD":
            o = o.transpose(1, 2)
        return o, lse[..., :q.shape[2]].float()  # (in case a kernel pads its LSE's rows)
    return run


def local_kernel(local="sage", **options) -> Callable:
    """The local attention function the parallel schemes call: fn(q, k, v, tensor_layout,
    is_causal, sm_scale) -> (o, lse), lse [B,H,N] float32 natural log, causal bottom-right
    aligned where Nq != Nk (the schemes only ask for it with Nq == Nk). local: "sage" (sageattn;
    options such as qk_bits go to it), "sdpa" (torch's SDPA kernels), or such a function."""
    if callable(local):
        if options:
            raise ValueError(f"local: options {sorted(options)} go to a named kernel only")
        return local
    if local == "sage":
        return _sage_kernel(**options)
    if local == "sdpa":
        return _sdpa_kernel(**options)
    raise ValueError(f"local = {local!r}: must be 'sage', 'sdpa' or a function "
                     "fn(q, k, v, tensor_layout, is_causal, sm_scale) -> (o, lse)")


# --- shared checks -------------------------------------------------------------------------------
def _group_info(group):
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first)")
    group = dist.group.WORLD if group is None else group
    return group, dist.get_world_size(group), dist.get_rank(group)


def _check_inputs(q, k, v, tensor_layout, is_causal, return_lse):
    if tensor_layout not in _lib.LAYOUTS:
        raise ValueError(f"tensor_layout = {tensor_layout!r}: must be 'HND' or 'NHD'")
    _lib.check_call_flags("bottom_right", is_causal, return_lse)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions ({'[B,H,N,D]' if tensor_layout == 'HND' else '[B,N,H,D]'}"
                             f" for tensor_layout={tensor_layout!r}), got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        # The collectives have no autograd: an output without its gradient would lose it.
        raise NotImplementedError("sage_attn.parallel is forward-only for now (no backward "
                                  "through the collectives); call it under torch.no_grad() or "
                                  "on tensors that do not require grad")
    hi = 1 if tensor_layout == "HND" else 2
    if q.shape[hi] % k.shape[hi]:
        raise ValueError(f"k: {k.shape[hi]} key/value heads must divide q's {q.shape[hi]} heads")


def _start(kernel, group, world, q, k, v, tensor_layout, is_causal, sm_scale, check_shapes,
           return_lse):
    """What both schemes do once their own checks pass: every rank's shapes compared
    (check_shapes, a group of more than one), the softmax scale, and a group of one running the
    local kernel alone. Returns (scale, the call's result for a group of one, else None)."""
    if check_shapes and world > 1:
        _check_same_shapes(group, world, q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    if world > 1:
        return scale, None
    o, lse = kernel(q, k, v, tensor_layout, is_causal, scale)
    return scale, ((o, lse) if return_lse else o)


def _check_same_shapes(group, world, q, k):
    """Every rank must pass the same shapes (equal shards): one small all_gather, so a mismatch
    is a ValueError on every rank instead of a hang or a wrong result."""
    mine = torch.tensor(list(q.shape) + list(k.shape), dtype=torch.int64,
                        device=q.device if q.is_cuda else "cpu")
    every = torch.empty((world * mine.numel(),), dtype=torch.int64, device=mine.device)
    dist.all_gather_into_tensor(every, mine, group=group)  # (gloo takes a flat output only)
    rows = every.view(world, -1).tolist()
    if any(r != rows[0] for r in rows):
        raise ValueError("q, k: every rank of the group must pass shards of one shape (equal "
                         "sequence shards); got q+k shapes " +
                         ", ".join(f"rank {i}: {tuple(r[:4])}+{tuple(r[4:])}"
                                   for i, r in enumerate(rows)))


# --- Ulysses -------------------------------------------------------------------------------------
def _all_to_all(x, group):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x, world, group, layout):
    """[B, H, n, D] shard of tokens (HND; NHD [B, n, H, D]) -> [B, H/W, W n, D]: every token of
    this rank's head group, tokens in rank order."""
    if layout == "HND":
        b, h, n, d = x.shape
        x = x.reshape(b, world, h // world, n, d).transpose(0, 1).contiguous()
        x = _all_to_all(x, group)  # [W (source rank: a sequence shard), B, H/W, n, D]
        return x.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * n, d)
    b, n, h, d = x.shape
    x = x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    x = _all_to_all(x, group)  # [W, B, n, H/W, D]
    return x.transpose(0, 1).reshape(b, world * n, h // world, d)


def _heads_to_seq(x, world, group, layout):
    """The inverse: [B, H/W, W n, D] (HND; NHD [B, W n, H/W, D]) -> [B, H, n, D] of my tokens."""
    if layout == "HND":
        b, hw, wn, d = x.shape
        n = wn // world
        x = x.reshape(b, hw, world, n, d).permute(2, 0, 1, 3, 4).contiguous()
        x = _all_to_all(x, group)  # [W (source rank: a head group), B, H/W, n, D]
        return x.transpose(0, 1).reshape(b, world * hw, n, d)
    b, wn, hw, d = x.shape
    n = wn // world
    x = x.reshape(b, world, n, hw, d).transpose(0, 1).contiguous()
    x = _all_to_all(x, group)  # [W, B, n, H/W, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, n, world * hw, d)


def _lse_heads_to_seq(lse, world, group):
    b, hw, wn = lse.shape
    n = wn // world
    x = lse.reshape(b, hw, world, n).permute(2, 0, 1, 3).contiguous()
    x = _all_to_all(x, group)  # [W (head group), B, H/W, n]
    return x.transpose(0, 1).reshape(b, world * hw, n)


def ulysses_attention(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None,
                      return_lse=False, *, group=None, local="sage", check_shapes=True,
                      **options):
    """DeepSpeed-Ulysses sequence parallelism: attention over the whole sequence, each rank
    holding a contiguous shard of it (rank r: tokens r n .. (r+1) n - 1 of W n, every head).

    q [B,Hq,n,D], k/v [B,Hkv,n,D] (HND; NHD [B,n,H,D]), the same shape on every rank. Two
    all-to-alls (q, k, v in; o, and lse if asked, out) around one local call over the full
    sequence with Hq/W query and Hkv/W key heads, so Hq and Hkv must both divide by the world
    size (a ValueError naming q or k otherwise; repeat K/V heads to a multiple of W first for
    MQA/GQA with fewer key heads than ranks). local: "sage" (sageattn, options such as qk_bits
    go to it), "sdpa", or a function (see local_kernel). group: a torch.distributed process group
    (None: WORLD). check_shapes: one small all_gather that turns unequal shards into a
    ValueError. Returns o (q's shape, this rank's tokens), or (o, lse) with lse [B,Hq,n]."""
    _check_inputs(q, k, v, tensor_layout, is_causal, return_lse)
    kernel = local_kernel(local, **options)
    group, world, _ = _group_info(group)
    hi = 1 if tensor_layout == "HND" else 2
    for name, x in (("q", q), ("k", k)):
        if x.shape[hi] % world:
            raise ValueError(f"{name}: {x.shape[hi]} heads do not divide by the group's world "
                             f"size {world} (Ulysses gives each rank H/W heads)")
    scale, alone = _start(kernel, group, world, q, k, v, tensor_layout, is_causal, sm_scale,
                          check_shapes, return_lse)
    if alone is not None:
        return alone
    qh, kh, vh = (_seq_to_heads(x, world, group, tensor_layout) for x in (q, k, v))
    o, lse = kernel(qh, kh, vh, tensor_layout, is_causal, scale)
    o = _heads_to_seq(o.contiguous(), world, group, tensor_layout)
    if not return_lse:
        return o
    return o, _lse_heads_to_seq(lse.contiguous(), world, group)


# --- ring ----------------------------------------------------------------------------------------
def zigzag_shard(x, rank, world_size, dim=2):
    """This rank's zig-zag shard of a whole sequence along dim (2 for HND, 1 for NHD): of 2W
    equal chunks, chunk `rank` then chunk 2W-1-rank (the layout causal ring_attention takes).
    The length must divide by 2 world_size (a ValueError otherwise)."""
    n = x.shape[dim]
    if n % (2 * world_size):
        raise ValueError(f"x: sequence length {n} (dim {dim}) must divide by 2 * world_size = "
                         f"{2 * world_size} for the zig-zag layout")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank}: must be in [0, world_size = {world_size})")
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards, dim=2):
    """The whole sequence from every rank's zig-zag shard (a list in rank order)."""
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(world)] +
                     [halves[r][1] for r in reversed(range(world))], dim=dim)


class _Ring:
    """The K/V block passing: send mine to rank+1, receive rank-1's, the next step's block in
    flight while the current one is used."""

    def __init__(self, group, world, rank):
        self.group = group
        self.send_to = dist.get_global_rank(group, (rank + 1) % world)
        self.recv_from = dist.get_global_rank(group, (rank - 1) % world)

    def start(self, block):
        incoming = torch.empty_like(block)
        ops = [dist.P2POp(dist.isend, block, self.send_to, self.group),
               dist.P2POp(dist.irecv, incoming, self.recv_from, self.group)]
        return dist.batch_isend_irecv(ops), incoming

    @staticmethod
    def finish(requests):
        for r in requests:
            r.wait()


def ring_attention(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None,
                   return_lse=False, *, group=None, local="sage", check_shapes=True, **options):
    """Ring attention: attention over the whole sequence, each rank holding a shard of it; the
    K/V shards go around the ring of the group's W ranks (W - 1 steps of send/recv) while the
    local kernel runs on the block at hand, and the partial outputs are merged through their
    LSEs (merge_attention's arithmetic, in float32; float64 for float64 inputs).

    Non-causal: any equal split of the sequence. Causal (is_causal=True): the shards must be in
    the zig-zag layout of zigzag_shard (rank r holds chunks r and 2W-1-r of 2W), which gives
    every rank the same work: against the block of rank j, rank r computes its own block
    causally (j = r), all its queries against j's first chunk (j < r: that chunk is before both
    of r's, j's second chunk after both), or its second chunk against all of j's (j > r: both
    of j's chunks lie between r's two). So the local length n must be even (the sequence
    length divide by 2W): a ValueError naming q otherwise.

    q [B,Hq,n,D], k/v [B,Hkv,n,D] (HND; NHD [B,n,H,D]), the same shape on every rank; any GQA
    ratio. local, options, group, check_shapes as for ulysses_attention. Returns o (q's
    shape and dtype), or (o, lse) with lse [B,Hq,n] float32. Both schemes are forward-only
    for now (inputs that require grad raise NotImplementedError)."""
    _check_inputs(q, k, v, tensor_layout, is_causal, return_lse)
    kernel = local_kernel(local, **options)
    group, world, rank = _group_info(group)
    ni = 2 if tensor_layout == "HND" else 1
    if q.shape[ni] != k.shape[ni]:
        raise ValueError(f"k: {k.shape[ni]} tokens per rank must equal q's {q.shape[ni]} "
                         "(ring attention shards queries and keys alike)")
    if is_causal and q.shape[ni] % 2:
        raise ValueError(f"q: {q.shape[ni]} tokens per rank is odd; causal ring attention takes "
                         "the zig-zag layout (two equal chunks a rank), so the sequence length "
                         f"must divide by 2 * world size = {2 * world}")
    scale, alone = _start(kernel, group, world, q, k, v, tensor_layout, is_causal, sm_scale,
                          check_shapes, return_lse)
    if alone is not None:
        return alone
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    half = q.shape[ni] // 2
    q_late = q.narrow(ni, half, half)  # (causal: my second chunk)
    ring = _Ring(group, world, rank)
    kv = torch.stack([k, v])  # one message a step
    o_acc = lse_acc = None
    for step in range(world):
        # The block of rank `source` is here; pass it on (and take the next) while computing.
        requests, kv_next = ring.start(kv) if step < world - 1 else ((), None)
        source = (rank - step) % world
        kb, vb = (k, v) if step == 0 else (kv[0], kv[1])
        if step == 0:  # my own block: causal as it stands (my two chunks, in order)
            o, lse = kernel(q, kb, vb, tensor_layout, is_causal, scale)
            o_acc, lse_acc = o.to(acc, copy=True), lse.to(acc, copy=True)
        elif not is_causal:
            o, lse = kernel(q, kb, vb, tensor_layout, False, scale)
            _merge_into(o_acc, lse_acc, o, lse, tensor_layout)
        elif source < rank:  # j's first chunk precedes both of mine; its second follows both
            o, lse = kernel(q, kb.narrow(ni, 0, half), vb.narrow(ni, 0, half), tensor_layout,
                            False, scale)
            _merge_into(o_acc, lse_acc, o, lse, tensor_layout)
        else:  # both of j's chunks lie between my two: my second chunk sees all of j's block
            o, lse = kernel(q_late, kb, vb, tensor_layout, False, scale)
            _merge_into(o_acc.narrow(ni, half, half), lse_acc.narrow(2, half, half), o, lse,
                        tensor_layout)
        ring.finish(requests)
        kv = kv_next
    o = o_acc.to(q.dtype)
    if not return_lse:
        return o
    return o, (lse_acc if acc == torch.float64 else lse_acc.to(torch.float32))
