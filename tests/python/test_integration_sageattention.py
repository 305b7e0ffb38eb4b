"""The official package's API (sage_attn.sageattention), the opt-in `import sageattention`
alias, and diffusers on top of both: `set_attention_backend("sage")` and the scoped switch, on a
random-init Flux-like transformer (tiny on the CPU, the real config's dims on the GPU). Alias and
backend tests run in a fresh interpreter (diffusers decides at import whether its sage backend is
usable; the alias is process-wide).

The diffusers bound: output within rel-L2 0.01 and cosine 0.9999 of the native backend's. Over
12 seeds the tiny Flux stayed within 5.6e-4 (its attention sees 80 tokens, where the 8-bit
algorithm's error is far below the transformer's own scale)."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import sage_attn  # noqa: E402
from sage_attn import sageattention as sa  # noqa: E402
from sage_attn import _torch as _t  # noqa: E402
from conftest import load_tool, naive_attention  # noqa: E402

HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with sm_89 or newer")
ROOT = pathlib.Path(__file__).resolve().parents[2]
FLUX_REL_L2, FLUX_COS = 0.01, 0.9999


def _qkv(rng, B, Hq, Hkv, Nq, Nk, D, layout):
    def make(H, N):
        shape = (B, H, N, D) if layout == "HND" else (B, N, H, D)
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    return make(Hq, Nq), make(Hkv, Nk), make(Hkv, Nk)


def _hnd(x, layout):
    return x if layout == "HND" else x.transpose(1, 2)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("fn", ["sageattn", "sageattn_qk_int8_pv_fp8_cuda",
                                "sageattn_qk_int8_pv_fp8_cuda_sm90",
                                "sageattn_qk_int8_pv_fp16_cuda",
                                "sageattn_qk_int8_pv_fp16_triton"])
def test_official_functions(rng, layout, fn):
    q, k, v = _qkv(rng, 2, 4, 2, 24, 40, 32, layout)
    o, lse = getattr(sa, fn)(q, k, v, tensor_layout=layout, is_causal=True, return_lse=True)
    ref_o, ref_lse = naive_attention(*(_hnd(x, layout).numpy() for x in (q, k, v)),
                                     causal="bottom_right")
    assert o.shape == q.shape and lse.shape == (2, 4, 24)
    got = _hnd(o, layout).double().numpy()
    assert np.abs(got - ref_o).sum() / np.abs(ref_o).sum() < 0.06
    assert np.abs(lse.double().numpy() - ref_lse).max() < 0.05  # (the INT8 scores: as test_torch_api)


def test_diffusers_and_comfyui_call_forms(rng):
    # diffusers: keywords q=, k=, v=, NHD, sm_scale; ComfyUI: attn_mask=None, tensor_layout.
    q, k, v = _qkv(rng, 1, 2, 2, 16, 16, 32, "NHD")
    o1 = sa.sageattn(q=q, k=k, v=v, tensor_layout="NHD", is_causal=False, sm_scale=0.2,
                     return_lse=False)
    o2 = sa.sageattn(q, k, v, attn_mask=None, is_causal=False, tensor_layout="NHD", sm_scale=0.2)
    assert torch.equal(o1, o2)
    ref, _ = naive_attention(q.numpy(), k.numpy(), v.numpy(), layout="NHD", scale=0.2)
    assert np.abs(o1.double().numpy() - ref).sum() / np.abs(ref).sum() < 0.06


def test_cuda_calls_follow_the_crossover_model(rng):
    """On CUDA (CPU tensors standing in: tools/dropin_host.py) the official functions send a
    call to sage only where the library's crossover model does, as the SDPA drop-in: a shape it
    hands to torch, in either layout, and a call that trains run torch's SDPA, silently; a
    longer shape, a call asking for the LSE (SDPA returns none) and every call with the
    crossover off run sage."""
    host = load_tool("dropin_host")
    with host.cuda_stand_in(prefer_sdpa=lambda a: a.seq_q < 64) as stand:
        def ran(fn, *args, **kw):
            runs, sdpa = stand.runs, stand.sdpa
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (the crossover's choice is silent)
                fn(*args, **kw)
            return {(1, 0): "sage", (0, 1): "sdpa"}[(stand.runs - runs, stand.sdpa - sdpa)]

        for layout in ("HND", "NHD"):
            short = [x.half() for x in _qkv(rng, 1, 4, 2, 32, 32, 64, layout)]
            long = [x.half() for x in _qkv(rng, 1, 4, 2, 96, 96, 64, layout)]
            for fn in (sa.sageattn, sa.sageattn_qk_int8_pv_fp8_cuda_sm90):
                assert ran(fn, *short, tensor_layout=layout) == "sdpa"
                assert ran(fn, *short, tensor_layout=layout, is_causal=True) == "sdpa"
                assert ran(fn, *long, tensor_layout=layout) == "sage"
                assert ran(fn, *short, tensor_layout=layout, return_lse=True) == "sage"
            grad = [x.clone().requires_grad_() for x in long]
            assert ran(sa.sageattn, *grad, tensor_layout=layout) == "sdpa"
            sage_attn.set_dropin_crossover(False)
            try:
                assert ran(sa.sageattn, *short, tensor_layout=layout) == "sage"
            finally:
                sage_attn.set_dropin_crossover(True)
        # Under torch.func.vmap (tensors without storage to plan with) each slice runs sage.
        x = torch.randn(3, 1, 2, 32, 64, dtype=torch.float16)
        runs = stand.runs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's note that the op has no batching rule)
            assert torch.vmap(lambda t: sa.sageattn(t, t, t))(x).shape == x.shape
        assert stand.runs - runs == 3


def test_mask_and_dropout_fall_back_to_sdpa(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 8, 12, 16, "HND")
    mask = torch.from_numpy(rng.random((1, 1, 8, 12)) > 0.3)
    mask[..., 0] = True
    with pytest.warns(UserWarning, match="attn_mask"):
        o = sa.sageattn(q, k, v, attn_mask=mask)
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    with pytest.raises(ValueError, match="return_lse"):
        sa.sageattn(q, k, v, attn_mask=mask, return_lse=True)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = sa.sageattn(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))


def test_bad_arguments_are_named(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 8, 8, 16, "HND")
    with pytest.raises(TypeError, match="bogus"):
        sa.sageattn(q, k, v, bogus=1)
    with pytest.raises(ValueError, match="tensor_layout"):
        sa.sageattn(q, k, v, tensor_layout="BHSD")
    with pytest.raises(ValueError, match="qk_quant_gran"):
        sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, qk_quant_gran="per_block")
    with pytest.raises(ValueError, match="pv_accum_dtype"):
        sa.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, pv_accum_dtype="fp16")
    with pytest.raises(ValueError, match="quantization_backend"):
        sa.sageattn_qk_int8_pv_fp16_triton(q, k, v, quantization_backend="cpu")


def test_varlen_int64_cu_seqlens(rng):
    lens = [5, 11]
    q = torch.from_numpy(rng.standard_normal((16, 4, 32)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((16, 2, 32)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((16, 2, 32)).astype(np.float32))
    cu = torch.tensor([0, 5, 16], dtype=torch.int64)
    o = sa.sageattn_varlen(q, k, v, cu, cu.clone(), 11, 11, is_causal=True)
    assert cu.dtype == torch.int64  # the caller's tensor is untouched
    start = 0
    for n in lens:
        seq = [x[start:start + n].permute(1, 0, 2)[None].numpy() for x in (q, k, v)]
        ref, _ = naive_attention(*seq, causal="bottom_right")
        got = o[start:start + n].permute(1, 0, 2)[None].double().numpy()
        assert np.abs(got - ref).sum() / np.abs(ref).sum() < 0.06
        start += n


def _fresh_python(code, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"),
                                                      env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_alias_is_opt_in():
    out = _fresh_python("""
        import importlib.util, importlib.metadata as md, json, sys
        import sage_attn
        before = importlib.util.find_spec("sageattention") is not None
        sage_attn.install_sageattention_alias()
        sage_attn.install_sageattention_alias()   # idempotent
        import sageattention
        from sageattention import sageattn, sageattn_varlen, sageattn_qk_int8_pv_fp8_cuda
        print(json.dumps({"before": before, "module": sageattention.__name__,
                          "version": md.version("sageattention"),
                          "attr": sageattention.__version__,
                          "found": importlib.util.find_spec("sageattention") is not None}))
    """)
    if out["before"]:
        pytest.skip("the official sageattention package is installed here")
    assert out["module"] == "sage_attn.sageattention" and out["found"]
    assert out["version"] == out["attr"] and out["version"].startswith("2.2.0+sage.")


FLUX_TINY = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
FLUX_REAL = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])

# Runs in a fresh interpreter: the alias before diffusers, then the native backend against
# set_attention_backend("sage"), counting the calls that reach sage_attn.sageattention.
_FLUX_SCRIPT = """
    import json, sys
    import torch
    import sage_attn
    sage_attn.install_sageattention_alias()
    import sage_attn.sageattention as sa
    calls = []
    real = sa._run
    def spy(*args):
        calls.append(args[0])
        return real(*args)
    sa._run = spy
    import diffusers
    from diffusers import FluxTransformer2DModel
    cfg, seed, device, dtype, n_img, n_txt, crossover = json.loads(
        sys.argv[1] if len(sys.argv) > 1 else %r)
    sage_attn.set_dropin_crossover(crossover)
    dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**cfg).to(device, dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    def rand(*shape):
        return torch.randn(shape, generator=g).to(device, dtype)
    side = int(n_img ** 0.5)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side) * 1.0,
                                         torch.arange(side) * 1.0,
                                         indexing="ij"), -1).reshape(-1, 3).to(device, dtype)
    inputs = dict(hidden_states=rand(1, n_img, cfg["in_channels"]),
                  encoder_hidden_states=rand(1, n_txt, cfg["joint_attention_dim"]),
                  pooled_projections=rand(1, cfg["pooled_projection_dim"]),
                  timestep=torch.rand(1, generator=g).to(device, dtype),
                  img_ids=img_ids, txt_ids=torch.zeros(n_txt, 3, device=device, dtype=dtype),
                  return_dict=False)
    if cfg.get("guidance_embeds"):
        inputs["guidance"] = torch.full((1,), 3.5, device=device, dtype=dtype)
    with torch.no_grad():
        ref = model(**inputs)[0].float()
        model.set_attention_backend("sage")
        got = model(**inputs)[0].float()
    d = got - ref
    print(json.dumps({"calls": len(calls), "equal": bool(torch.equal(got, ref)),
                      "rel": (d.norm() / ref.norm()).item(),
                      "cos": torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(),
                                                                   dim=0).item(),
                      "blocks": cfg["num_layers"] + cfg["num_single_layers"]}))
"""


def _flux(cfg, seed, device, dtype, n_img, n_txt, crossover=True):
    pytest.importorskip("diffusers")
    args = json.dumps([cfg, seed, device, dtype, n_img, n_txt, crossover])
    return _fresh_python(_FLUX_SCRIPT % args)


def test_diffusers_sage_backend(rng):
    out = _flux(FLUX_TINY, int(rng.integers(2**31)), "cpu", "float32", 64, 16)
    assert out["calls"] == out["blocks"]  # every block's attention reached sage
    assert not out["equal"]
    assert out["rel"] < FLUX_REL_L2 and out["cos"] > FLUX_COS, out


def test_diffusers_under_scoped_switch(rng, monkeypatch):
    diffusers = pytest.importorskip("diffusers")
    calls = []
    real = _t.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((args or (kwargs["query"],))[0].shape)  # (diffusers passes query=...)
        return real(*args, **kwargs)
    monkeypatch.setattr(_t, "scaled_dot_product_attention", spy)
    torch.manual_seed(int(rng.integers(2**31)))
    model = diffusers.FluxTransformer2DModel(**FLUX_TINY).eval()
    inputs = dict(hidden_states=torch.randn(1, 36, 8), encoder_hidden_states=torch.randn(1, 8, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.rand(1),
                  img_ids=torch.randint(0, 6, (36, 3)).float(), txt_ids=torch.zeros(8, 3),
                  return_dict=False)
    with torch.no_grad():
        ref = model(**inputs)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the drop-in's "non-CUDA tensors" note)
            with sage_attn.sdpa():
                got = model(**inputs)[0]
        after = model(**inputs)[0]
    assert len(calls) == 2  # both blocks went through the drop-in, and only inside the block
    # CPU tensors: the drop-in hands them to torch's SDPA, so the outputs agree exactly here;
    # the GPU test below has sage compute them.
    assert torch.equal(ref, got) and torch.equal(ref, after)


@gpu
def test_gpu_flux_real_config(rng):
    # Flux.1's transformer dims (24 heads of 128, joint text+image attention), 1 double and 1
    # single block, random weights, bf16, 1024x1024's 4096 image tokens + 512 text tokens. Its
    # joint call sits at the crossover on Hopper (torch's SDPA there by the model): the
    # crossover off, so that sage computes every block.
    out = _flux(FLUX_REAL, int(rng.integers(2**31)), "cuda", "bfloat16", 4096, 512,
                crossover=False)
    print("flux real config, sage backend vs native:", out)
    assert out["calls"] == 2 and not out["equal"]
    assert out["rel"] < FLUX_REL_L2 * 5 and out["cos"] > 0.999, out


@gpu
def test_gpu_flux_under_scoped_switch(rng):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(int(rng.integers(2**31)))
    model = diffusers.FluxTransformer2DModel(**FLUX_REAL).to("cuda", torch.bfloat16).eval()
    dev, dt = "cuda", torch.bfloat16
    side = 64
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side) * 1.0,
                                         torch.arange(side) * 1.0,
                                         indexing="ij"), -1).reshape(-1, 3).to(dev, dt)
    inputs = dict(hidden_states=torch.randn(1, 4096, 64, device=dev, dtype=dt),
                  encoder_hidden_states=torch.randn(1, 512, 4096, device=dev, dtype=dt),
                  pooled_projections=torch.randn(1, 768, device=dev, dtype=dt),
                  timestep=torch.rand(1, device=dev, dtype=dt), img_ids=img_ids,
                  txt_ids=torch.zeros(512, 3, device=dev, dtype=dt),
                  guidance=torch.full((1,), 3.5, device=dev, dtype=dt), return_dict=False)
    # Flux's joint call (24 heads, 4608 tokens) sits at the crossover on Hopper, where the
    # drop-in's choice depends on the GPU: sage runs every call here (what the switch does where
    # sage measured faster).
    sage_attn.set_dropin_crossover(False)
    try:
        with torch.no_grad():
            ref = model(**inputs)[0].float()
            with sage_attn.sdpa():
                got = model(**inputs)[0].float()
    finally:
        sage_attn.set_dropin_crossover(True)
    rel = ((got - ref).norm() / ref.norm()).item()
    cos = F.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    print(f"flux real config under sage_attn.sdpa(): rel-L2 {rel:.4f}, cos {cos:.6f}")
    assert not torch.equal(got, ref)
    assert rel < FLUX_REL_L2 * 5 and cos > 0.999, (rel, cos)
