# Host time per call of each layer of sageattn (D=64 causal N=1024, B=4 H=32), microseconds:
# the whole call, the custom op, its implementation without the op dispatch, and the two C calls
# alone. Rows are timed back to back: one whose GPU work exceeds its host time reads the GPU's.
import time, torch, sage_attn
from sage_attn import _lib, _torch as T

def host_us(fn, n=300):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return dt

q, k, v = (torch.randn(4, 32, 1024, 64, device="cuda", dtype=torch.half) for _ in range(3))
mask = _lib.CAUSAL_ALIGNS["bottom_right"]
scale = 64 ** -0.5
o = torch.empty_like(q); lse = torch.empty((0,), device="cuda")
a = T._build_args(q, k, v, o, lse, _lib.LAYOUT_HND, mask, scale, None, None, None, None)
a.backend = _lib.BACKEND_CUDA
a.stream = torch.cuda.current_stream().cuda_stream
nbytes = _lib.workspace_size(a)
ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
a.workspace, a.workspace_size = ws.data_ptr(), nbytes

rows = [
    ("sageattn", lambda: sage_attn.sageattn(q, k, v, is_causal=True)),
    ("custom op", lambda: T._attention_op(q, k, v, _lib.LAYOUT_HND, mask, scale, None, None, None, None, False, 0)),
    ("op body (_attention)", lambda: T._attention(q, k, v, _lib.LAYOUT_HND, mask, scale, None, None, None, None, False, 0)),
    ("_build_args", lambda: T._build_args(q, k, v, o, lse, _lib.LAYOUT_HND, mask, scale, None, None, None, None)),
    ("torch.cuda.device ctx", lambda: torch.cuda.device(q.device).__enter__()),
    ("3x torch.empty", lambda: (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty((0,), device=q.device), torch.empty(nbytes, dtype=torch.uint8, device=q.device))),
    ("C workspace_size", lambda: _lib.workspace_size(a)),
    ("C sage_attention", lambda: _lib.run(a)),
    ("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
]
for name, fn in rows:
    print(f"{name:24s} {host_us(fn):8.1f} us/call", flush=True)
