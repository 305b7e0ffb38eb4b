# sm90 vs mma on structured inputs: LSE (scores, max, sum) and V=1 (O/l consistency).
import os, torch, sage_attn
torch.manual_seed(0)
dev = "cuda"
D = int(os.environ.get("D", "128"))
q = torch.randn(1, 1, 128, D, device=dev, dtype=torch.half)
k = torch.randn(1, 1, 256, D, device=dev, dtype=torch.half)
kb1 = torch.zeros_like(k); kb1[:, :, 128:] = k[:, :, 128:]
v1 = torch.ones(1, 1, 256, D, device=dev, dtype=torch.half)
vr = torch.randn(1, 1, 256, D, device=dev, dtype=torch.half)
for name, kk in (("K only in block 1", kb1), ("random K", k)):
    for vname, vv in (("V=1", v1), ("V random", vr)):
        o, lse = sage_attn.sageattn(q, kk, vv, smooth_v=False, smooth_k=False, return_lse=True)
        s = (q.float() @ kk.float().transpose(-1, -2)) / D ** 0.5
        ref_lse = torch.logsumexp(s, -1)
        ref = torch.softmax(s, -1) @ vv.float()
        print(f"{name:18s} {vname:9s} lse err max {(lse - ref_lse).abs().max().item():.4f} "
              f"| o err max {(o.float() - ref).abs().max().item():.4f} o[0,:3] {o[0,0,0,:3].tolist()}")
