"""transformers integration: `import sage_attn.transformers` registers the attention
implementation "sage", so

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sage")
    model.set_attn_implementation("sage")

run the model's attention through sage (GQA natively: no repeat of K/V heads).

Which calls run sage: on CUDA tensors those the SDPA drop-in would give sage (no mask, no
dropout, a head dim with a kernel, and a shape where the library's crossover model has sage
faster on this GPU: decoding steps and short prompts stay with torch's SDPA;
sage_attn.set_dropin_crossover(False) sends every call it can to sage). CPU tensors run the
library's CPU reference (slow; it is there to test a model's accuracy under sage without a GPU).
Padding masks: the call goes to transformers' own "sdpa" function with the mask, unchanged (no
packing into a varlen call, which would need the mask read on the host every step); so do
attention with dropout in training, a position bias, or output_attentions. The mask builder is
the one "sdpa" uses, so a causal mask without padding is skipped and runs sage.
"""
from __future__ import annotations

from . import _torch as _t

NAME = "sage"


def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def sage_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           is_causal=None, **kwargs):
    """transformers' attention-function contract: query [B,Hq,Nq,D], key/value [B,Hkv,Nk,D];
    returns (attn_output [B,Nq,Hq,D], None)."""
    if kwargs.get("softcap") is not None:
        raise ValueError("softcap: the 'sage' attention implementation has no logit softcapping; "
                         "use attn_implementation='eager'")
    if (attention_mask is not None or dropout != 0.0 or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions", False) or query.dim() != 4):
        return _sdpa_forward()(module, query, key, value, attention_mask, dropout=dropout,
                               scaling=scaling, is_causal=is_causal, **kwargs)
    nq = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # (SDPA's rule: a single query attends to every cached key; causal is top-left aligned.)
    causal = bool(causal) and nq > 1
    if query.is_cuda:
        o = _t.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling,
                                            enable_gqa=query.shape[1] != key.shape[1])
    else:
        o = _t.sageattn(query, key, value, is_causal=causal, sm_scale=scaling,
                        causal_align="top_left")
    return o.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers "sage" in transformers' AttentionInterface (the attention function) and, where
    transformers has it, AttentionMaskInterface (the mask builder "sdpa" uses: without it a
    model would build no mask for "sage" and padding would be ignored). Idempotent."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, sage_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers: masks are built by each model, not by name
        return
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()

__all__ = ["register", "sage_attention_forward", "NAME"]
