# sm90 vs mma with peaky attention: a P/V key pairing error shows up as a large error here.
import os, torch, sage_attn
torch.manual_seed(1)
for D in (64, 128):
    for scale in (0.09, 0.3, 1.0):
        q = torch.randn(1, 2, 256, D, device="cuda", dtype=torch.half)
        k = torch.randn(1, 2, 256, D, device="cuda", dtype=torch.half)
        v = torch.randn(1, 2, 256, D, device="cuda", dtype=torch.half)
        ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1) @ v.double()
        out = {}
        for kern in ("sm90", "mma"):
            os.environ["SAGE_KERNEL"] = kern
            out[kern] = sage_attn.sageattn(q, k, v, sm_scale=scale).double()
        rel = lambda a, b: ((a - b).abs().sum() / b.abs().sum()).item()
        print(f"D={D} scale={scale}: sm90 vs f64 {rel(out['sm90'], ref):.4f}  mma vs f64 {rel(out['mma'], ref):.4f}  sm90 vs mma {rel(out['sm90'], out['mma']):.4f}")
