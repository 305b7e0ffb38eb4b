# Debug probes of the sm90 kernel with structured inputs (run on the device).
import torch, sage_attn
torch.manual_seed(0)
dev = "cuda"
def run(q, k, v, **kw):
    return sage_attn.sageattn(q, k, v, **kw).float()
def ref(q, k, v):
    s = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(s, -1) @ v.float()
D = 128
for nk in (128, 256, 384):
    q = torch.randn(1, 1, 128, D, device=dev, dtype=torch.half)
    k = torch.randn(1, 1, nk, D, device=dev, dtype=torch.half)
    print(f"--- Nk={nk}")
    v = torch.ones(1, 1, nk, D, device=dev, dtype=torch.half)
    print("V=1 (expect 1):", run(q, k, v, smooth_v=False).mean().item(), run(q, k, v, smooth_v=False)[0,0,:4,0].tolist())
    k0 = torch.zeros_like(k)
    v = torch.randn(1, 1, nk, D, device=dev, dtype=torch.half)
    o = run(q, k0, v, smooth_v=False)
    print("K=0 uniform: err vs mean(V):", (o - v.float().mean(2, keepdim=True)).abs().max().item())
    for blk in range(nk // 128):
        vb = torch.zeros_like(v); vb[:, :, blk*128:(blk+1)*128] = v[:, :, blk*128:(blk+1)*128]
        o = run(q, k0, vb, smooth_v=False)
        print(f"  V only in block {blk}: err", (o - vb.float().mean(2, keepdim=True)).abs().max().item(),
              "o[0,:3]", o[0,0,0,:3].tolist(), "want", vb.float().mean(2)[0,0,:3].tolist())
    o = run(q, k, v, smooth_v=False)
    r = ref(q, k, v)
    print("random: rel", ((o - r).abs().sum() / r.abs().sum()).item())
    # Scores: K only in one block nonzero (others 0) -> check via V=key index one-hot-ish
    for blk in range(nk // 128):
        kb = torch.zeros_like(k); kb[:, :, blk*128:(blk+1)*128] = k[:, :, blk*128:(blk+1)*128]
        o = run(q, kb, v, smooth_v=False); r = ref(q, kb, v)
        print(f"  K only in block {blk}: rel", ((o - r).abs().sum() / r.abs().sum()).item())
