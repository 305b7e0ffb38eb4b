"""The C++ fast path (sage_attn._fastpath, _dropin_fast.cpp): built against the installed torch,
it repeats the routes and plans that the Python drop-in, sageattn and the official-API alias
decided. Each test here would fail if the fast path answered a call the Python path would answer
otherwise: another signature, a mode that sees the op, a subclass, a mask, a call that trains;
or if its output differed from the Python path's."""
import os
import pathlib
import shutil

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from conftest import count_calls  # noqa: E402

import sage_attn  # noqa: E402
from sage_attn import _torch as T  # noqa: E402
from sage_attn import _fastpath as fastpath  # noqa: E402

GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def fast():
    """The built module (built here into SAGE_FASTPATH_DIR where scripts/test did not)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the fast path")
    try:
        fastpath.build()
    except RuntimeError as e:
        pytest.fail(str(e))
    module = fastpath.load()
    assert module is not None
    return module


@pytest.fixture
def table(fast):
    """The fast path with an empty route table, cleared again after the test."""
    fast.clear()
    yield fast
    fast.clear()


def args_of(q, k, v, mask=None, dropout=0.0, causal=False, scale=None, gqa=False):
    return (q, k, v, mask, dropout, causal, scale, gqa)


def randn(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def test_build_is_named_by_torch_python_and_source(fast):
    p = fastpath.path()
    assert p.is_file() and torch.__version__.replace("+", "_") in p.name
    assert p.parent == pathlib.Path(os.environ["SAGE_FASTPATH_DIR"])


def test_load_respects_the_switch(fast, monkeypatch):
    monkeypatch.setenv("SAGE_FASTPATH", "0")
    assert fastpath.load() is None


def test_torch_route_matches_torch(table):
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (randn(2, 4, 37, 16, dtype=dtype) for _ in range(3))
        for causal, scale in ((False, None), (True, None), (False, 0.3), (True, 2)):
            a = args_of(q, k, v, causal=causal, scale=scale)
            assert table.call(*a) is None  # not remembered yet
            assert table.remember(*a, 1, None, 0) is True
            out = table.call(*a)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            assert out is not None and out.dtype == dtype and torch.equal(out, ref)


def test_gqa_and_strided_inputs(table):
    q = randn(1, 8, 40, 16)
    kv = randn(1, 40, 2, 16).transpose(1, 2)  # NHD storage read as HND: not contiguous
    a = args_of(q, kv, kv, gqa=True)
    table.remember(*a, 1, None, 0)
    out = table.call(*a)
    assert torch.equal(out, F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True))
    # the same shapes with other strides are another signature
    assert table.call(q, kv.contiguous(), kv.contiguous(), None, 0.0, False, None, True) is None


def test_every_part_of_the_signature_is_in_the_key(table):
    q, k, v = (randn(1, 2, 24, 16) for _ in range(3))
    base = args_of(q, k, v)
    table.remember(*base, 1, None, 0)
    assert table.call(*base) is not None
    other = [
        args_of(randn(1, 2, 25, 16), k, v),                        # a size
        args_of(q.double(), k.double(), v.double()),               # the dtype
        args_of(q, k, v, causal=True),                             # the mask flag
        args_of(q, k, v, scale=0.25),                              # the scale
        args_of(q, k, v, scale=1),                                 # an int scale (the Python
        args_of(q, k, v, dropout=0.5),                             #  type is keyed too)
        args_of(q, k, v, gqa=True),                                # enable_gqa
        args_of(q, k, torch.randn(1, 2, 16, 24).transpose(2, 3)),  # value's strides
    ]
    for a in other:
        assert table.call(*a) is None
    table.remember(*args_of(q, k, v, scale=1), 1, None, 0)
    assert table.call(*args_of(q, k, v, scale=1.0)) is None  # 1.0 is not the int 1's key


def test_alignment_of_the_query_is_in_the_key(table):
    buf = randn(1 * 2 * 24 * 16 + 1, dtype=torch.float16)
    q_aligned = buf[:-1].view(1, 2, 24, 16)
    q_offset = buf[1:].view(1, 2, 24, 16)  # 2 bytes past a 16-byte boundary
    assert q_aligned.data_ptr() % 16 == 0 and q_offset.data_ptr() % 16 != 0
    k, v = (randn(1, 2, 24, 16, dtype=torch.float16) for _ in range(2))
    table.remember(*args_of(q_aligned, k, v), 1, None, 0)
    assert table.call(*args_of(q_offset, k, v)) is None


def test_training_calls_are_their_own_key_and_keep_autograd(table):
    q, k, v = (randn(1, 2, 20, 8) for _ in range(3))
    table.remember(*args_of(q, k, v), 1, None, 0)
    qg = q.clone().requires_grad_()
    assert table.call(*args_of(qg, k, v)) is None  # trains: another key
    with torch.no_grad():
        assert table.call(*args_of(qg, k, v)) is not None  # no gradient wanted: the same key
    table.remember(*args_of(qg, k, v), 1, None, 0)
    out = table.call(*args_of(qg, k, v))
    out.sum().backward()
    qr = q.clone().requires_grad_()
    F.scaled_dot_product_attention(qr, k, v).sum().backward()
    assert torch.equal(qg.grad, qr.grad)


def test_what_the_python_path_keeps_is_not_answered(table):
    q, k, v = (randn(1, 2, 16, 8) for _ in range(3))
    a = args_of(q, k, v)
    table.remember(*a, 1, None, 0)

    class Sub(torch.Tensor):
        pass

    mask = torch.ones(16, 16, dtype=torch.bool)
    assert table.remember(*args_of(q, k, v, mask=mask), 1, None, 0) is False
    assert table.call(*args_of(q, k, v, mask=mask)) is None
    assert table.call(*args_of(q.as_subclass(Sub), k, v)) is None
    assert table.call(q, k, v, None, 0.0, 1, None, False) is None  # is_causal not a bool
    assert table.call(q, k, v, None, 0.0, False, torch.tensor(0.5), False) is None
    with torch.overrides.TorchFunctionMode():
        assert table.call(*a) is None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert table.call(*a) is None
    seen = []
    torch.func.vmap(lambda x: seen.append(table.call(x, k[0], v[0], None, 0.0, False, None,
                                                     False)) or x)(q)
    assert seen == [None]
    assert table.call(*a) is not None  # and outside them, the route again


def test_an_op_that_raises_goes_back_to_python(table):
    """torch's error is raised by the Python path's own call, not lost in C++ (here: a route
    remembered for arguments SDPA rejects)."""
    q, k = randn(1, 2, 4, 8), randn(1, 3, 5, 8)
    a = args_of(q, k, k)
    table.remember(*a, 1, None, 0)
    assert table.call(*a) is None
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, k)


def test_bad_arguments_raise(table):
    q = randn(1, 1, 4, 8)
    with pytest.raises(TypeError):
        table.call(q, q, q)
    with pytest.raises(ValueError):
        table.remember(*args_of(q, q, q), 3, None, 0)
    with pytest.raises(TypeError):
        table.configure((0, 8), 1, len)
    with pytest.raises(ValueError):
        table.configure((0, 8, 16, 24, 32, 40, 44), 1, len)  # a pointer past the struct's end


def test_the_dropin_hands_repeated_calls_to_the_fast_path(fast, monkeypatch):
    """Through sage_attn.scaled_dot_product_attention: a route to torch decided once in Python,
    then answered in C++ until the crossover switch changes."""
    monkeypatch.setattr(T, "_fast", fast)
    fast.clear()
    decided = []

    def to_torch(*a):
        decided.append(a)
        return T._SHORT  # torch's SDPA, silently

    monkeypatch.setattr(T, "_dropin_route_of", to_torch)
    q, k, v = (randn(1, 2, 30, 16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        for _ in range(3):
            assert torch.equal(sage_attn.scaled_dot_product_attention(q, k, v, is_causal=True),
                               ref)
        assert len(decided) == 1
        sage_attn.set_dropin_crossover(T._use_crossover)  # any setting clears the table
        sage_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert len(decided) == 2
    finally:
        fast.clear()


def test_a_replaced_torch_sdpa_is_not_bypassed(fast, monkeypatch):
    """Where something else stood in torch's SDPA's place when sage_attn was imported, the drop-in
    calls that function every time, as its Python path does."""
    monkeypatch.setattr(T, "_fast", fast)
    fast.clear()
    calls = []

    def other_sdpa(*a, **kw):
        calls.append(1)
        return F.scaled_dot_product_attention(*a, **kw)

    monkeypatch.setattr(T, "_torch_sdpa", other_sdpa)
    monkeypatch.setattr(T, "_dropin_route_of", lambda *a: T._SHORT)
    q = randn(1, 1, 8, 8)
    for _ in range(3):
        sage_attn.scaled_dot_product_attention(q, q, q)
    assert len(calls) == 3 and fast.size() == 0


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_sage_route_on_the_gpu_is_the_python_paths(fast, monkeypatch):
    """The direct route to sage: the same bits as the Python path's run, from the second call
    on without a Python decision; and handed back to Python on another current device."""
    monkeypatch.setattr(T, "_fast", fast)
    fast.clear()
    sage_attn.set_dropin_crossover(False)
    try:
        decided = []
        real = T._dropin_route_of

        def counted(*a):
            decided.append(1)
            return real(*a)

        monkeypatch.setattr(T, "_dropin_route_of", counted)
        for dtype, causal, n, d in ((torch.float16, False, 1000, 128), (torch.bfloat16, True,
                                                                        333, 64)):
            q, k, v = (randn(2, 4, n, d, dtype=dtype, device="cuda") for _ in range(3))
            outs = [sage_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    for _ in range(3)]
            before = len(decided)
            monkeypatch.setattr(T, "_fast", None)  # (sageattn's own plan stays out of the table)
            ref = sage_attn.sageattn(q, k, v, is_causal=causal)
            monkeypatch.setattr(T, "_fast", fast)
            for o in outs:
                assert torch.equal(o, ref)
            assert before == len(decided)
        assert len(decided) == 2  # one decision per signature
        assert fast.size() == 2
    finally:
        sage_attn.set_dropin_crossover(True)
        fast.clear()


def sageattn_args(q, k, v, layout="HND", causal=False, scale=None, qk_bits=None, smooth_k=True,
                  smooth_q=None, smooth_v=None, align="bottom_right", kernel=None):
    return (q, k, v, layout, causal, scale, qk_bits, smooth_k, smooth_q, smooth_v, align, kernel)


@pytest.fixture
def configured(table):
    """The table configured with the library's entry point and struct (T._fast_configure)."""
    import ctypes

    from sage_attn import _lib
    A = _lib.AttentionArgs
    offsets = (A.q.offset, A.k.offset, A.v.offset, A.o.offset, A.stream.offset,
               A.workspace.offset, ctypes.sizeof(A))
    run = ctypes.cast(_lib.library().sage_attention, ctypes.c_void_p).value
    table.configure(offsets, run, lambda index: 0)
    yield table, bytes(ctypes.sizeof(A))


def test_sageattn_keys(configured):
    """What a sageattn call's key takes: its keywords as the Python checks accept them, and no
    training call (those need the op, for autograd); anything else has no key."""
    table, struct = configured
    q, k, v = (randn(1, 2, 24, 16, dtype=torch.float16) for _ in range(3))
    assert table.remember_sageattn(*sageattn_args(q, k, v), struct, 1) is True
    for a in (sageattn_args(q, k, v, layout="NHD", causal=True, scale=0.5, qk_bits=4,
                            smooth_k=False, smooth_q=True, smooth_v=False, align="top_left",
                            kernel="sm90"),
              sageattn_args(q, k, v, scale=1, kernel="auto")):
        assert table.remember_sageattn(*a, struct, 1) is True
    for a in (sageattn_args(q, k, v, layout="hnd"), sageattn_args(q, k, v, causal=1),
              sageattn_args(q, k, v, smooth_k=1), sageattn_args(q, k, v, align="bottom"),
              sageattn_args(q, k, v, kernel="fast"), sageattn_args(q, k, v, qk_bits=True),
              sageattn_args(q, k, v, scale=torch.tensor(0.5))):
        assert table.remember_sageattn(*a, struct, 1) is False
    qg = q.clone().requires_grad_()
    assert table.remember_sageattn(*sageattn_args(qg, k, v), struct, 1) is False
    with pytest.raises(ValueError):
        table.remember_sageattn(*sageattn_args(q, k, v), struct[:-1], 1)  # not the struct's size
    with pytest.raises(ValueError):
        table.remember_sageattn(*sageattn_args(q, k, v), struct, 0)
    # CPU tensors: remembered, but the run is CUDA's only, so the Python path answers
    assert table.sageattn(*sageattn_args(q, k, v)) is None


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_sageattn_on_the_gpu_is_the_python_paths(fast, monkeypatch):
    """Repeated sageattn calls: from the second on, no Python checks, and the bits of the
    Python path's run (HND and NHD, causal both alignments, GQA, 4-bit, a given scale)."""
    monkeypatch.setattr(T, "_fast", fast)
    fast.clear()
    checks = []
    real = T._check_tensors
    monkeypatch.setattr(T, "_check_tensors", lambda *a: checks.append(1) or real(*a))
    cases = [dict(), dict(tensor_layout="NHD"), dict(is_causal=True),
             dict(is_causal=True, causal_align="top_left"), dict(sm_scale=0.1, qk_bits=4),
             dict(kernel="mma")]
    try:
        for kw in cases:
            q = randn(2, 8, 333, 128, dtype=torch.bfloat16, device="cuda")
            k, v = (randn(2, 2, 300, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            if kw.get("tensor_layout") == "NHD":
                q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            before = len(checks)
            outs = [sage_attn.sageattn(q, k, v, **kw) for _ in range(3)]
            assert len(checks) == before + 1  # one Python decision per signature
            monkeypatch.setattr(T, "_fast", None)
            ref = sage_attn.sageattn(q, k, v, **kw)
            monkeypatch.setattr(T, "_fast", fast)
            for o in outs:
                assert torch.equal(o, ref)
        # a call that trains still goes through the op: a gradient comes back
        q = randn(1, 2, 200, 64, dtype=torch.float16, device="cuda").requires_grad_()
        k, v = (randn(1, 2, 200, 64, dtype=torch.float16, device="cuda") for _ in range(2))
        for _ in range(2):
            q.grad = None
            sage_attn.sageattn(q, k, v).float().sum().backward()
            assert q.grad is not None and torch.isfinite(q.grad).all()
    finally:
        fast.clear()


def python_signature(q, k, v, mask, dropout, causal, scale, gqa):
    """The drop-in's own signature of a call (sage_attn._torch._dropin_route_of), which decides
    whether two calls share a route there."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, q.data_ptr() % 16 == 0, dropout, causal,
            scale, type(scale), gqa, torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad))


def test_a_hit_is_always_the_python_signature(table, rng):
    """Random calls against one remembered call: whenever the fast path answers a call, the
    Python drop-in's signature of it is the remembered call's (so it would have taken the same
    route), and its output is torch's."""
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    def tensor(shape, dtype):
        base = torch.randn(2 * int(torch.tensor(shape).prod()) + 8, generator=gen).to(dtype)
        layout = pick(["contiguous", "offset", "transposed"])
        if layout == "offset":  # the same shape, 2 elements into its storage
            return base[2:2 + int(torch.tensor(shape).prod())].view(shape)
        if layout == "transposed":  # the same shape, other strides
            return base[:int(torch.tensor(shape).prod())].view(
                shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)
        return base[:int(torch.tensor(shape).prod())].view(shape)

    def random_call():
        dtype = pick([torch.float16, torch.bfloat16, torch.float32])
        b, h, n, d = pick([1, 2]), pick([2, 4]), pick([16, 24]), pick([8, 16])
        hkv = pick([h, 1])
        q = tensor((b, h, n, d), dtype)
        k, v = tensor((b, hkv, n, d), dtype), tensor((b, hkv, n, d), dtype)
        if pick([False, False, True]):
            q = q.detach().requires_grad_()
        return (q, k, v, None, pick([0.0, 0]), pick([False, True]),
                pick([None, 0.25, 0.5, 1, 1.0]), hkv != h or pick([False, True]))

    hits = 0
    for _ in range(40):
        table.clear()
        first = random_call()
        grad_on = pick([True, False])
        with torch.set_grad_enabled(grad_on):
            assert table.remember(*first, 1, None, 0) is True
            sig = python_signature(*first)
        for _ in range(25):
            other = random_call() if pick([True, True, False]) else first
            with torch.set_grad_enabled(pick([grad_on, not grad_on])):
                out = table.call(*other)
                if out is None:
                    continue
                hits += 1
                assert python_signature(*other) == sig
                q, k, v, _, dropout, causal, scale, gqa = other
                ref = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                     is_causal=causal, scale=scale,
                                                     enable_gqa=gqa)
                assert torch.equal(out, ref)
    assert hits >= 40  # (each remembered call repeated about a third of the time)


def test_alias_routes(table, monkeypatch):
    """The official-API alias (sage_attn.sageattention): its route to torch's SDPA run in C++
    gives _sdpa_fallback's output (either layout, GQA, causal, a given scale); its route to
    sageattn is decided once per signature; what needs a mask object stays in Python."""
    from sage_attn import sageattention as sa
    monkeypatch.setattr(T, "_fast", table)
    for layout, causal, scale, hq, hkv in (("NHD", False, None, 4, 4), ("HND", True, 0.3, 8, 2),
                                           ("NHD", True, 1, 8, 1)):
        shape = (lambda h: (2, 30, h, 16)) if layout == "NHD" else (lambda h: (2, h, 30, 16))
        q, k, v = randn(*shape(hq)), randn(*shape(hkv)), randn(*shape(hkv))
        table.clear()
        sa._fast_keep(3, q, k, v, layout, causal, scale, True, None)
        assert table.size() == 1
        out = table.alias(q, k, v, layout, causal, scale, True, None)
        ref = sa._sdpa_fallback(q, k, v, layout, causal, scale, None, 0.0)
        assert torch.equal(out, ref) and out.stride() == ref.stride()
        assert table.alias(q, k, v, layout, not causal, scale, True, None) is None
    # a causal call with Nq != Nk needs torch's lower-right mask object: not kept
    table.clear()
    q, kv = randn(1, 2, 20, 16), randn(1, 2, 30, 16)
    sa._fast_keep(3, q, kv, kv, "HND", True, None, True, None)
    assert table.size() == 0
    # the route to sageattn (CPU tensors: the library's CPU reference), decided once
    decided = count_calls(monkeypatch, sa, "_crossover_prefers_sdpa")
    q = randn(1, 40, 2, 16)
    outs = [sa.sageattn(q, q, q, tensor_layout="NHD") for _ in range(3)]
    assert len(decided) == 1 and table.alias(q, q, q, "NHD", False, None, True, None) is True
    monkeypatch.setattr(T, "_fast", None)
    ref = sa.sageattn(q, q, q, tensor_layout="NHD")
    for o in outs:
        assert torch.equal(o, ref)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_alias_on_the_gpu(fast, monkeypatch):
    """The alias on CUDA with the crossover on: a call handed to torch and a call run with sage,
    each decided once, each the Python path's output."""
    from sage_attn import sageattention as sa
    monkeypatch.setattr(T, "_fast", fast)
    fast.clear()
    decided = count_calls(monkeypatch, sa, "_crossover_prefers_sdpa")
    try:
        for n in (256, 16384):  # (the first shorter than any routed length, the second not)
            q, k, v = (randn(1, n, 8, 64, dtype=torch.float16, device="cuda") for _ in range(3))
            before = len(decided)
            outs = [sa.sageattn(q, k, v, tensor_layout="NHD") for _ in range(3)]
            assert len(decided) == before + 1
            monkeypatch.setattr(T, "_fast", None)
            ref = sa.sageattn(q, k, v, tensor_layout="NHD")
            monkeypatch.setattr(T, "_fast", fast)
            for o in outs:
                assert torch.equal(o, ref)
    finally:
        fast.clear()
