# Probe (CUDA GPU on sm_90, torch and an installed or SAGE_LIBRARY-named sage_attn): the
# forward-normalized 16-bit backward (config.normalizer SAGE_BWD_NORM_FORWARD, no INT8 product,
# called through the C API's ctypes binding) beside SDPA's. Modes:
#   acc       dq, dk, dv against float64 beside SDPA flash's backward (bf16, four channels of Q and
#             K x4; GQA and causal rows), the O and LSE from SDPA flash's forward
#   speed     bf16, B*N = 32k, H 16, D 64/128, N 1k/4k/16k, both masks, CUDA-graph replay: this
#             backward alone, SDPA cuDNN's and flash's backward, flash's forward + this one
#   cudnnfwd  SDPA cuDNN's forward (with its LSE) + this backward against cuDNN's forward + backward
#   sage      this backward alone on a few shapes (same-call A/Bs: one process per library, TAG)
#   once      one D 128 N 4k call, for a profiler
# Results in bench/results/ (2026-11-29-h200-bwd-forward-normalized-*.txt).
# Run: python tools/probes/bwd_forward_normalized.py MODE
import sys, torch
from sage_attn import _lib
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F

def sage_bwd(q, k, v, o, lse, do, causal, dq, dk, dv, ws):
    a = _lib.new_backward_args()
    a.q, a.k, a.v, a.o, a.lse, a.d_o = (x.data_ptr() for x in (q, k, v, o, lse, do))
    a.d_lse = None
    a.dq, a.dk, a.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    a.batch, a.heads_q, a.seq_q, a.head_dim = q.shape
    a.heads_kv, a.seq_kv = k.shape[1], k.shape[2]
    a.layout = _lib.LAYOUT_HND
    for f, x in (("q_strides", q), ("k_strides", k), ("v_strides", v), ("o_strides", o),
                 ("do_strides", do), ("dq_strides", dq), ("dk_strides", dk), ("dv_strides", dv)):
        _lib.set_strides(getattr(a, f), _lib.LAYOUT_HND, list(x.stride()))
    a.dtype = _lib.DTYPE_BF16 if q.dtype == torch.bfloat16 else _lib.DTYPE_FP16
    a.scale = 0.0
    a.mask = _lib.MASK_CAUSAL_TOP_LEFT if causal else _lib.MASK_NONE
    a.variant = _lib.VARIANT_CUSTOM
    a.config.int8, a.config.smooth, a.config.normalizer = 0, 0, 1
    a.backend = _lib.BACKEND_CUDA
    a.stream = torch.cuda.current_stream().cuda_stream
    n = _lib.backward_workspace_size(a)
    if ws[0] is None or ws[0].numel() < n:
        ws[0] = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.workspace, a.workspace_size = ws[0].data_ptr(), ws[0].numel()
    _lib.run_backward(a)

def flash_fwd(q, k, v, causal):
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    return r[0], r[1]

def gtime(f, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): f()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g): f()
    torch.cuda.synchronize()
    best = 1e30
    for _ in range(3):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(reps): g.replay()
        e1.record(); torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / reps)
    return best

def cos_rel(x, t):
    x, t = x.double().flatten(), t.double().flatten()
    return (x @ t / (x.norm() * t.norm())).item(), ((x - t).abs().sum() / t.abs().sum()).item()

mode = sys.argv[1] if len(sys.argv) > 1 else "all"
torch.manual_seed(0)
dt = torch.bfloat16
if mode in ("acc", "all"):
    for (B, H, Hk, N, D, c) in [(1, 4, 4, 1024, 128, False), (1, 8, 2, 2048, 128, True),
                                (2, 4, 4, 1000, 64, True), (1, 4, 1, 777, 64, False)]:
        q = torch.randn(B, H, N, D, device="cuda", dtype=dt)
        k = torch.randn(B, Hk, N, D, device="cuda", dtype=dt)
        v = torch.randn(B, Hk, N, D, device="cuda", dtype=dt)
        q[..., :4] *= 4; k[..., :4] *= 4  # outlier channels
        do = torch.randn(B, H, N, D, device="cuda", dtype=dt)
        kr, vr = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
        qd, kd, vd = (x.double().requires_grad_() for x in (q, kr, vr))
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=c)
        od.backward(do.double())
        group = lambda g: g.view(B, Hk, H // Hk, N, D).sum(2)
        tdq, tdk, tdv = qd.grad, group(kd.grad), group(vd.grad)
        o, lse = flash_fwd(q, kr, vr, c)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        sage_bwd(q, k, v, o, lse.contiguous(), do, c, dq, dk, dv, [None])
        torch.cuda.synchronize()
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, kr, vr))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=c).backward(do)
        sdk, sdv = group(ks.grad), group(vs.grad)
        line = f"acc B{B} H{H}/{Hk} N{N} D{D} c{int(c)}:"
        for nm, x, s_, t in (("dq", dq, qs.grad, tdq), ("dk", dk, sdk, tdk), ("dv", dv, sdv, tdv)):
            a1, b1 = cos_rel(x, t); a2, b2 = cos_rel(s_, t)
            nan = int(torch.isnan(x).any())
            line += f" {nm} cos {a1:.6f} rl1 {b1:.4f} (sdpa {a2:.6f} {b2:.4f}) nan {nan};"
        print(line, flush=True)
def cudnn_fwd(q, k, v, causal):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    lse = r[1]
    return r[0], (lse.squeeze(-1) if lse.dim() == 4 else lse)

if mode == "cudnnfwd":  # cuDNN's forward (with its LSE) + this backward, against cuDNN fwd+bwd
    for D in (128, 64):
        for N in (1024, 4096, 16384):
            for c in (False, True):
                B, H = 32768 // N, 16
                q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(4))
                o, lse = cudnn_fwd(q, k, v, c)
                if D == 128 and N == 1024 and not c:  # the cuDNN forward's O and LSE serve
                    o2, l2 = flash_fwd(q, k, v, c)
                    print("cudnn vs flash fwd: o max diff", (o - o2).abs().max().item(),
                          "lse max diff", (lse - l2).abs().max().item(), tuple(lse.shape),
                          lse.is_contiguous(), flush=True)
                lse = lse.contiguous()
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                ws = [None]
                reps = 20 if N >= 4096 else 50
                def ours():
                    oo, ll = cudnn_fwd(q, k, v, c)
                    sage_bwd(q, k, v, oo, ll.contiguous(), do, c, dq, dk, dv, ws)
                t = gtime(ours, reps)
                qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
                def fb():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=c)
                    torch.autograd.grad(out, (qs, ks, vs), do)
                tc = gtime(fb, reps)
                fl = 4 * B * H * N * N * D * (0.5 if c else 1.0) * 3.5
                print(f"fwdbwd D{D} N{N} c{int(c)}: cudnn fwd + this bwd {t:.3f} ms "
                      f"({fl / t / 1e9:.0f} TOPS), "
                      f"cudnn fwd+bwd {tc:.3f} ms ({fl / tc / 1e9:.0f}); {tc / t:.2f}x", flush=True)
if mode == "once":  # one call for a profiler: D 128, N 4k, B 8, H 16
    q, k, v, do = (torch.randn(8, 16, 4096, 128, device="cuda", dtype=dt) for _ in range(4))
    o, lse = flash_fwd(q, k, v, False); lse = lse.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ws = [None]
    for _ in range(2): sage_bwd(q, k, v, o, lse, do, False, dq, dk, dv, ws)
    torch.cuda.synchronize()
if mode == "sage":  # this backward alone, for same-call A/Bs (TAG names the library)
    import os
    for D, N, c in [(128, 1024, False), (128, 4096, False), (128, 4096, True), (128, 16384, False),
                    (128, 16384, True), (64, 4096, False), (64, 16384, True)]:
        B, H = 32768 // N, 16
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(4))
        o, lse = flash_fwd(q, k, v, c); lse = lse.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ws = [None]
        t = gtime(lambda: sage_bwd(q, k, v, o, lse, do, c, dq, dk, dv, ws), 20 if N >= 4096 else 50)
        fl = 4 * B * H * N * N * D * (0.5 if c else 1.0) * 2.5
        tag = os.environ.get("TAG", "?")
        print(f"{tag} D{D} N{N} c{int(c)}: {t:.3f} ms {fl / t / 1e9:.0f} TOPS", flush=True)
if mode in ("speed", "all"):
    for D in (128, 64):
        for N in (1024, 4096, 16384):
            for c in (False, True):
                B, H = 32768 // N, 16
                q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(4))
                o, lse = flash_fwd(q, k, v, c); lse = lse.contiguous()
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                ws = [None]
                reps = 20 if N >= 4096 else 50
                t_sage = gtime(lambda: sage_bwd(q, k, v, o, lse, do, c, dq, dk, dv, ws), reps)
                t_ff = gtime(lambda: flash_fwd(q, k, v, c), reps)
                res = {}
                for nm, be in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                               ("flash", SDPBackend.FLASH_ATTENTION)):
                    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
                    def fb():
                        with sdpa_kernel(be):
                            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=c)
                        torch.autograd.grad(out, (qs, ks, vs), do)
                    def fo():
                        with sdpa_kernel(be):
                            F.scaled_dot_product_attention(q, k, v, is_causal=c)
                    try:
                        res[nm] = (gtime(fb, reps), gtime(fo, reps))
                    except Exception as e:
                        res[nm] = (float("nan"), float("nan"))
                fl = 4 * B * H * N * N * D * (0.5 if c else 1.0)
                tops = lambda ms, mult: fl * mult / ms / 1e9
                cf, cfo = res["cudnn"]; ff, ffo = res["flash"]
                print(f"speed D{D} N{N} c{int(c)}: bwd sage {t_sage:.3f} ms "
                      f"({tops(t_sage, 2.5):.0f} TOPS) | cudnn bwd {cf - cfo:.3f} "
                      f"({tops(cf - cfo, 2.5):.0f}) flash bwd {ff - ffo:.3f} | fwd+bwd: "
                      f"flash-fwd+sage {t_ff + t_sage:.3f} ({tops(t_ff + t_sage, 3.5):.0f}), "
                      f"cudnn {cf:.3f} ({tops(cf, 3.5):.0f}), "
                      f"flash {ff:.3f} ({tops(ff, 3.5):.0f}); "
                      f"vs cudnn {cf / (t_ff + t_sage):.2f}x", flush=True)
