"""cuDNN's FP8 attention as the benchmark's anchor (kernel-only): nvidia-cudnn-frontend's Python
graph API, op `sdpa_fp8`, on Q, K, V quantized beforehand to FP8 E4M3 with one scale per tensor.
Only the graph's execution is timed; the quantization and the dequantization of the output
(for the accuracy columns) happen outside it. Any GPU cuDNN runs FP8 attention on (sm_90+)."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


class CudnnFp8Unavailable(RuntimeError):
    """cudnn is not importable, or cuDNN has no FP8 attention for these arguments."""


def _import_cudnn():
    try:
        import cudnn  # nvidia-cudnn-frontend
    except Exception as e:  # ImportError, or a libcudnn that fails to load
        raise CudnnFp8Unavailable(f"nvidia-cudnn-frontend is not importable "
                                  f"({type(e).__name__}: {e})") from None
    return cudnn


_handles: dict = {}


def _handle(cudnn, device):
    # One cuDNN handle per device for the process: creating one costs milliseconds.
    if device not in _handles:
        with torch.cuda.device(device):
            _handles[device] = cudnn.create_handle()
    return _handles[device]


def quantize_e4m3(x):
    """x as float8_e4m3fn scaled so that max|x| maps to 448, and the descale (max|x| / 448,
    a float32 [1,1,1,1] device tensor) that turns it back: x ≈ x8.float() * descale."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    descale = (amax / E4M3_MAX).reshape(1, 1, 1, 1)
    # The clamp keeps a rounding of max|x| / descale just above 448 from turning into NaN.
    x8 = (x.float() / descale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


class CudnnFp8Attention:
    """One built cuDNN graph for q, k, v ([B, H, N, D] fp16/bf16 CUDA tensors) and a mask.
    Calling it executes the graph on the current stream (nothing else); result() is the last
    output dequantized to float32. Raises CudnnFp8Unavailable when cuDNN cannot run it."""

    def __init__(self, q, k, v, causal, scale=None):
        cudnn = _import_cudnn()
        if not (q.is_cuda and q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
            raise CudnnFp8Unavailable("needs 4-D [B, H, N, D] CUDA tensors")
        self.cudnn = cudnn
        self.device = q.device
        self.handle = _handle(cudnn, q.device)
        self.scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
        self.causal = bool(causal)
        self.q8, self.descale_q = quantize_e4m3(q)
        self.k8, self.descale_k = quantize_e4m3(k)
        self.v8, self.descale_v = quantize_e4m3(v)
        ones = torch.ones((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        # P = softmax(S) lies in [0, 1]: cuDNN quantizes it with scale_s = 448 (descale 1/448).
        self.scale_s, self.descale_s = ones * E4M3_MAX, ones / E4M3_MAX
        # Each output row is a convex combination of V's rows, so |O| <= max|V|: that bound as the
        # output's scale never saturates (FP8 output, which is what Hopper supports).
        v_amax = self.descale_v * E4M3_MAX
        self._fp8_out_scale, self._fp8_out_descale = E4M3_MAX / v_amax, v_amax / E4M3_MAX
        self._ones = ones
        self.amax_s = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        self.amax_o = torch.zeros_like(self.amax_s)
        self._stream = None
        self._set_stream()
        # A 16-bit output where cuDNN offers one (Blackwell, cuDNN >= 9.13), FP8 otherwise.
        attempts = [(cudnn.data_type.HALF if q.dtype == torch.float16 else cudnn.data_type.BFLOAT16,
                     q.dtype), (cudnn.data_type.FP8_E4M3, torch.float8_e4m3fn)]
        errors = []
        for cudnn_type, torch_type in attempts:
            try:
                self._build(cudnn_type, torch_type)
                break
            except Exception as e:  # cudnnGraphNotSupportedError, or a frontend/API mismatch
                errors.append(f"{cudnn_type}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        else:
            raise CudnnFp8Unavailable("sdpa_fp8 graph not built (" + "; ".join(errors) + ")")
        self.output_type = torch_type

    def _set_stream(self):
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if stream != self._stream:  # also follows a CUDA-graph capture's side stream
            self.cudnn.set_stream(handle=self.handle, stream=stream)
            self._stream = stream

    def _build(self, cudnn_type, torch_type):
        cudnn = self.cudnn
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self.handle)

        def tensor(name, x, dtype):
            return g.tensor(name=name, dim=list(x.shape), stride=list(x.stride()), data_type=dtype)

        fp8_out = torch_type == torch.float8_e4m3fn
        scale_o = self._fp8_out_scale if fp8_out else self._ones
        self.descale_o = self._fp8_out_descale if fp8_out else self._ones
        out = torch.empty(self.q8.shape, dtype=torch_type, device=self.device)
        buffers = {"q": (self.q8, fp8), "k": (self.k8, fp8), "v": (self.v8, fp8),
                   "descale_q": (self.descale_q, f32), "descale_k": (self.descale_k, f32),
                   "descale_v": (self.descale_v, f32), "descale_s": (self.descale_s, f32),
                   "scale_s": (self.scale_s, f32), "scale_o": (scale_o, f32)}
        t = {name: tensor(name, x, dtype) for name, (x, dtype) in buffers.items()}
        kwargs = dict(attn_scale=self.scale, use_causal_mask=self.causal, name="sdpa_fp8", **t)
        try:
            o, _stats, amax_s, amax_o = g.sdpa_fp8(generate_stats=False, **kwargs)
        except TypeError:  # a frontend older than generate_stats (1.13) takes is_inference
            o, _stats, amax_s, amax_o = g.sdpa_fp8(is_inference=True, **kwargs)
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
        o.set_data_type(cudnn_type)
        for a in (amax_s, amax_o):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8,
                                     device=self.device)
        self.pack = {t[name]: x for name, (x, _) in buffers.items()}
        self.pack.update({o: out, amax_s: self.amax_s, amax_o: self.amax_o})
        self.graph, self.out = g, out

    def __call__(self):
        self._set_stream()
        self.graph.execute(self.pack, self.workspace, handle=self.handle)

    def result(self):
        """The last output as float32 in the inputs' units."""
        return self.out.float() * self.descale_o
