"""The SDPA drop-in's route cache (sage_attn._torch._dropin_route_of), on CPU tensors that pass
for CUDA ones (tools/dropin_host.py's cuda_stand_in): a repeated call is answered from one
lookup, and the cache never changes an answer."""
import contextlib
import warnings

import pytest

torch = pytest.importorskip("torch")

import sage_attn  # noqa: E402
from sage_attn import _lib, _torch as T  # noqa: E402
from conftest import load_tool  # noqa: E402

host = load_tool("dropin_host")


def qkv(shape=(1, 4, 96, 64), dtype=torch.float16, kv_heads=None, **kw):
    b, h, n, d = shape
    kv = (b, kv_heads or h, n, d)
    return (torch.randn(shape, dtype=dtype, **kw), torch.randn(kv, dtype=dtype, **kw),
            torch.randn(kv, dtype=dtype, **kw))


@pytest.fixture
def counted(monkeypatch):
    """Counts of the plan key's computations and of the full argument checks."""
    counts = {"key": 0, "checks": 0}
    key, checks = T._key, T._sdpa_unsupported

    def counting_key(c):
        counts["key"] += 1
        return key(c)

    def counting_checks(*args, **kw):
        counts["checks"] += 1
        return checks(*args, **kw)

    monkeypatch.setattr(T, "_key", counting_key)
    monkeypatch.setattr(T, "_sdpa_unsupported", counting_checks)
    return counts


@pytest.fixture
def crossover_on():
    yield
    sage_attn.set_dropin_crossover(True)


def fresh(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """The drop-in's answer with every check run (no cache): "sage", "" or the warning's text."""
    route = T._dropin_decide(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)
    return "sage" if route.reason is None else route.reason


def cached(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False):
    """The drop-in's answer through the cache, asked twice (the second from the cache)."""
    answers = []
    for _ in range(2):
        route = T._dropin_route_of(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa)
        answers.append("sage" if route.reason is None else route.reason)
    assert answers[0] == answers[1]
    return answers[0]


def test_repeated_call_is_one_lookup(counted):
    """A repeated call computes neither the plan key nor the checks again, on either route; its
    run gets the same struct as the first call's (but for the pointers)."""
    q, k, v = qkv()
    for prefer_sdpa, ran in ((False, "runs"), (True, "sdpa")):
        with host.cuda_stand_in(prefer_sdpa=prefer_sdpa) as stand:
            sage_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert counted == {"key": 1, "checks": 1} and stand.plans == 1
            first = stand.last_run
            for _ in range(3):
                sage_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert counted == {"key": 1, "checks": 1} and stand.plans == 1
            assert getattr(stand, ran) == 4 and stand.runs + stand.sdpa == 4
            if first is not None:
                a = stand.last_run
                assert bytes(first)[:8] == bytes(a)[:8]  # (struct_size)
                assert (a.batch, a.heads_q, a.seq_q, a.head_dim, a.mask, a.scale,
                        a.workspace_size) == (1, 4, 96, 64, _lib.MASK_CAUSAL_TOP_LEFT, 0.125,
                                              256)
                assert (a.q, a.k, a.v) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
        counted.update(key=0, checks=0)


def test_copied_inputs_plan_their_copy(counted):
    """An input whose head dim is not contiguous runs on a contiguous copy: the route is kept,
    and the run looks the copy's plan up (its alignment is not the signature's)."""
    q, k, v = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in qkv())
    assert q.stride(-1) != 1
    with host.cuda_stand_in() as stand:
        for _ in range(3):
            sage_attn.scaled_dot_product_attention(q, k, v)
        assert stand.runs == 3 and stand.plans == 1 and counted["checks"] == 1
        assert counted["key"] == 1 + 3  # the route's plan, then each run's lookup
        a = stand.last_run
        assert (a.q_strides.token, a.q_strides.head) == (64, 96 * 64)


def nhd(x):
    """x's values in [B,N,H,D] memory, viewed as [B,H,N,D]: other strides, same shape."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def misaligned(x):
    """x's values at an address 8 bytes past a 16-byte boundary."""
    flat = torch.empty(x.numel() + 8, dtype=x.dtype)
    off = next(i for i in range(8) if (flat.data_ptr() + i * x.element_size()) % 16 == 8)
    y = flat[off:off + x.numel()].view(x.shape)
    y.copy_(x)
    return y


# (name, the plan's answer prefer_sdpa as a function of its argument struct, and the call that
# differs from the base call (q, k, v) in one input only): the rule answers the base call "sage",
# and the variation either gets the other answer or fails a check. Devices are not varied: the
# stand-in has one.
VARIATIONS = [
    ("q strides", lambda a: a.q_strides.token != a.head_dim, lambda q, k, v: ((nhd(q), k, v), {})),
    ("k strides", lambda a: a.k_strides.token != a.head_dim, lambda q, k, v: ((q, nhd(k), v), {})),
    ("v strides", lambda a: a.v_strides.token != a.head_dim, lambda q, k, v: ((q, k, nhd(v)), {})),
    ("q shape", lambda a: a.seq_q != 96, lambda q, k, v: ((q[:, :, :50], k, v), {})),
    ("k, v shape", lambda a: a.seq_kv != 96, lambda q, k, v: ((q, k[:, :, :50], v[:, :, :50]), {})),
    ("k shape", None, lambda q, k, v: ((q, k[:, :, :50], v), {})),
    ("v shape", None, lambda q, k, v: ((q, k, v[:, :, :50]), {})),
    ("dtype", lambda a: a.dtype == _lib.DTYPE_BF16,
     lambda q, k, v: ((q.bfloat16(), k.bfloat16(), v.bfloat16()), {})),
    ("q dtype", None, lambda q, k, v: ((q.bfloat16(), k, v), {})),
    ("k dtype", None, lambda q, k, v: ((q, k.bfloat16(), v), {})),
    ("v dtype", None, lambda q, k, v: ((q, k, v.bfloat16()), {})),
    ("q alignment", lambda a: a.q % 16 != 0, lambda q, k, v: ((misaligned(q), k, v), {})),
    ("is_causal", lambda a: a.mask != _lib.MASK_NONE, lambda q, k, v: ((q, k, v),
                                                                       {"is_causal": True})),
    ("scale", lambda a: a.scale != 0.125, lambda q, k, v: ((q, k, v), {"scale": 0.3})),
    ("bad scale", None, lambda q, k, v: ((q, k, v), {"scale": -1.0})),
    ("dropout_p", None, lambda q, k, v: ((q, k, v), {"dropout_p": 0.1})),
    ("heads", None, lambda q, k, v: ((q, k[:, :2], v[:, :2]), {})),
    ("enable_gqa", lambda a: a.heads_kv != a.heads_q,
     lambda q, k, v: ((q, k[:, :2], v[:, :2]), {"enable_gqa": True})),
]
# (The same with a base call that has other heads for k and v than for q: enable_gqa alone
# decides whether the checks take it.)
GQA_BASE = ("enable_gqa alone", None,
            lambda q, k, v: ((q, k[:, :2], v[:, :2]), {"enable_gqa": True}))


@pytest.mark.parametrize("sdpa_below", [0, 40])
@pytest.mark.parametrize("name,rule,vary", VARIATIONS + [GQA_BASE],
                         ids=[v[0] for v in VARIATIONS + [GQA_BASE]])
def test_each_input_of_the_answer_is_in_the_signature(name, rule, vary, sdpa_below):
    """One input changed, the base call's answer cached: the changed call gets its own answer
    (the one every check gives), not the base call's. sdpa_below 40: a least routed length under
    every query here, so that the shortcut's reads of the query (which the signature reuses) run
    first and let the call through."""
    with host.cuda_stand_in(prefer_sdpa=rule or False, sdpa_below=sdpa_below):
        q, k, v = qkv()
        base = ((q, k[:, :2], v[:, :2]), {}) if vary is GQA_BASE[2] else ((q, k, v), {})
        want_base = fresh(*base[0], **base[1])
        assert cached(*base[0], **base[1]) == want_base
        args, kw = vary(q, k, v)
        want = fresh(*args, **kw)
        assert want != want_base
        assert cached(*args, **kw) == want
        assert cached(*base[0], **base[1]) == want_base


def test_a_scale_of_another_type_has_its_own_signature():
    """A scale the checks refuse for its type (a Fraction, which compares and hashes equal to
    the float they take) gets the checks' answer, whichever of the two was cached first."""
    from fractions import Fraction
    with host.cuda_stand_in(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, k, v = qkv()
        assert fresh(q, k, v, scale=0.125) == "sage"
        assert fresh(q, k, v, scale=Fraction(1, 8)) == "scale = Fraction(1, 8)"
        for order in ((0.125, Fraction(1, 8)), (Fraction(1, 8), 0.125)):
            T._routes.clear()
            for s in order:
                assert cached(q, k, v, scale=s) == fresh(q, k, v, scale=s)
            assert len(T._routes) == 2


def test_cache_never_changes_an_answer(crossover_on):
    """Training or not, grad mode, the crossover switch, deterministic algorithms: each call gets
    the answer a call with every check gets, asked after the others were cached."""
    with host.cuda_stand_in(prefer_sdpa=lambda a: a.seq_q < 64, prefer_sdpa_training=False,
                            has_backward=lambda a: a.head_dim == 64):
        q, k, v = qkv()
        short = qkv((1, 4, 32, 64))
        d80 = qkv((1, 4, 96, 80))
        grad = [x.clone().requires_grad_() for x in (q, k, v)]
        grad80 = [x.clone().requires_grad_() for x in d80]
        grad_k = (q, k.clone().requires_grad_(), v)
        grad80_q = (d80[0].clone().requires_grad_(), d80[1], d80[2])
        grad80_k = (d80[0], d80[1].clone().requires_grad_(), d80[2])
        grad80_v = (d80[0], d80[1], d80[2].clone().requires_grad_())
        calls = [(q, k, v), short, d80, grad, grad80, grad_k, grad80_q, grad80_k, grad80_v]
        for _ in range(2):  # the second round: each answer with every other one cached
            for args in calls:
                assert cached(*args) == fresh(*args)
                with torch.no_grad():
                    assert cached(*args) == fresh(*args)
        assert cached(q, k, v) == "sage" and cached(*short) == ""
        assert cached(*grad) == "sage"  # training: prefer_sdpa_training, has the backward
        for args in (grad80, grad80_q, grad80_k, grad80_v):
            assert cached(*args).startswith("no backward kernel")
        assert cached(*grad_k) == "sage" and cached(*(x.detach() for x in grad80)) == "sage"
        with torch.no_grad():
            assert cached(*grad80) == "sage"
        with torch.inference_mode():
            assert cached(*grad80) == "sage"
        # The switch: off, the crossover hands nothing over; on again, the first answer.
        sage_attn.set_dropin_crossover(False)
        assert cached(*short) == fresh(*short) == "sage"
        sage_attn.set_dropin_crossover(True)
        assert cached(*short) == ""
        # Deterministic algorithms: the forward's answer does not read them.
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            assert cached(q, k, v) == fresh(q, k, v) == "sage"
        finally:
            torch.use_deterministic_algorithms(prev)


def test_what_runs_is_what_dropin_backend_says(crossover_on):
    """A call that trains or not, with the switch either way, runs what dropin_backend says,
    cache or not."""
    with host.cuda_stand_in(prefer_sdpa=True, prefer_sdpa_training=True) as stand:
        q, k, v = qkv()
        grad = [x.clone().requires_grad_() for x in (q, k, v)]
        for switch in (True, False, True):
            sage_attn.set_dropin_crossover(switch)
            for args in ((q, k, v), grad):
                want = sage_attn.dropin_backend(*args)
                for _ in range(2):  # (a training call that runs sage: through the op)
                    runs, sdpa = stand.runs, stand.sdpa
                    sage_attn.scaled_dot_product_attention(*args)
                    assert (stand.runs - runs, stand.sdpa - sdpa) == (
                        (1, 0) if want == "sage" else (0, 1)), (switch, args is grad)
                assert want == ("sage" if not switch else "sdpa")


def test_fallback_warnings_stay_once_per_reason(monkeypatch):
    """A cached fallback still warns through _warn_once: once per reason, and again once the
    record of warnings is cleared."""
    monkeypatch.setattr(T, "_warned", set())
    with host.cuda_stand_in() as stand:
        q, k, v = (x.float() for x in qkv())  # float32 on "CUDA": no kernel
        for _ in range(2):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                for _ in range(3):
                    sage_attn.scaled_dot_product_attention(q, k, v)
            assert len(w) == 1 and "dtype torch.float32" in str(w[0].message)
            T._warned.clear()
        assert stand.sdpa == 6


def test_uncacheable_calls_run_every_check(counted):
    """A mask, a tensor subclass or an unhashable argument: no signature, every check on every
    call, and the answer of the checks."""
    class Sub(torch.Tensor):
        pass

    with host.cuda_stand_in() as stand, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, k, v = qkv()
        mask = torch.ones(96, 96, dtype=torch.bool)
        for _ in range(2):
            sage_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert counted["checks"] == 2 and stand.sdpa == 2
        sub = [x.as_subclass(Sub) for x in (q, k, v)]
        for _ in range(2):
            sage_attn.scaled_dot_product_attention(*sub)
        assert counted["checks"] == 4 and stand.runs == 2
        for _ in range(2):
            sage_attn.scaled_dot_product_attention(q, k, v, scale=[0.5])  # SDPA rejects it
        assert counted["checks"] == 6 and stand.sdpa == 4
        assert T._routes == {}


def test_compiling_reads_no_cache(monkeypatch):
    """While torch.compile traces, the drop-in neither reads nor fills the cache: the op makes
    the choice."""
    seen = []
    monkeypatch.setattr(T, "_call", lambda c, prep=None: seen.append((c.fallback, prep)) or (
        c.q, None))
    with host.cuda_stand_in() as stand:
        q, k, v = qkv()
        sage_attn.scaled_dot_product_attention(q, k, v)
        assert len(T._routes) == 1
        assert stand.runs == 1 and seen == []  # (eager: launched by the drop-in itself)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        T._routes.clear()
        sage_attn.scaled_dot_product_attention(q, k, v)
        assert T._routes == {}
    assert seen == [(T._FALLBACK_SDPA, None)]


POINTERS = ("q", "k", "v", "o", "workspace")


def fields(a):
    """The argument struct's fields but its pointers (the call's tensors and allocations)."""
    b = T._AttentionArgs.from_buffer_copy(a)
    for name in POINTERS:
        setattr(b, name, None)
    return bytes(b)


class Recorded(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def through_call(monkeypatch):
    """The routed calls that go through _call (the op's way), recorded."""
    seen = []
    call = T._call

    def recording(c, prep=None):
        seen.append(c)
        return call(c, prep)

    monkeypatch.setattr(T, "_call", recording)
    return seen


def test_direct_launch_is_the_op_paths_call(through_call):
    """An eager call on plain tensors that sage runs is launched by the drop-in itself, with
    the struct, output and workspace the op's path (_call -> _attention -> _run_cuda) gives the
    same call; a function or dispatch mode sends it through the op's path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for shape, kw in (((1, 4, 96, 64), {}), ((2, 4, 50, 64), {"is_causal": True}),
                      ((1, 4, 96, 64), {"scale": 0.3})):
        for make in (lambda x: x, nhd):
            q, k, v = (make(x) for x in qkv(shape))
            with host.cuda_stand_in() as stand:
                o = sage_attn.scaled_dot_product_attention(q, k, v, **kw)
                assert stand.runs == 1 and through_call == []
                direct = stand.last_run
                assert (direct.q, direct.k, direct.v, direct.o) == (
                    q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
                assert o.shape == q.shape and o.is_contiguous() and o.dtype == q.dtype
                for mode in (Recorded, Dispatched):
                    with mode():
                        o2 = sage_attn.scaled_dot_product_attention(q, k, v, **kw)
                    assert len(through_call) == 1 and stand.runs == 2
                    assert fields(stand.last_run) == fields(direct)
                    assert o2.shape == o.shape and o2.stride() == o.stride()
                    through_call.clear()
                    stand.runs = 1


def test_direct_launch_only_where_nothing_needs_the_op(through_call):
    """Not launched directly: a training call (the op, for its backward), inputs copied to a
    contiguous head dim (their plan is looked up), a tensor subclass (never cached)."""
    class Sub(torch.Tensor):
        pass

    q, k, v = qkv()
    grad = [x.clone().requires_grad_() for x in (q, k, v)]
    copied = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v)]
    sub = [x.as_subclass(Sub) for x in (q, k, v)]
    with host.cuda_stand_in(prefer_sdpa_training=False) as stand:
        for args in (grad, copied, sub):
            for _ in range(2):
                sage_attn.scaled_dot_product_attention(*args)
            route = T._dropin_decide(*args, None, 0.0, False, None, False)
            assert route.reason is None and not route.direct
        assert stand.runs == 6 and len(through_call) == 6
        sage_attn.scaled_dot_product_attention(q, k, v)
        assert stand.runs == 7 and len(through_call) == 6


def test_direct_launch_on_another_device_sets_it():
    """The direct launch makes the query's device current for the library's call where another
    one is (as _attention does)."""
    import contextlib
    entered = []
    with host.cuda_stand_in() as stand:  # (which puts back what it and this test replace)
        q, k, v = qkv()
        sage_attn.scaled_dot_product_attention(q, k, v)  # (the route: its plan sets the device)
        torch.cuda.device = lambda d: entered.append(d) or contextlib.nullcontext()
        sage_attn.scaled_dot_product_attention(q, k, v)
        assert entered == [] and stand.runs == 2
        torch.cuda.current_device = lambda: 1
        sage_attn.scaled_dot_product_attention(q, k, v)
        assert entered == [q.device] and stand.runs == 3


def test_workspace_is_allocated_in_the_querys_dtype():
    """The run allocates the plan's workspace in elements of the query's dtype: never fewer
    bytes than the plan asks for, never an element more than it needs, never none."""
    for size, itemsize, elements in ((0, 2, 1), (1, 2, 1), (2, 2, 1), (255, 2, 128),
                                     (256, 2, 128), (257, 2, 129), (257, 4, 65), (4096, 4, 1024)):
        info = _lib.PlanInfo()
        info.workspace_size = size
        prep = T._Prepared(_lib.new_args(), info, itemsize)
        assert prep.workspace == size and prep.workspace_alloc == elements
    allocated = []
    with host.cuda_stand_in(workspace=257) as stand:
        real_run = _lib.run

        def run(a):
            allocated.append(a.workspace)
            real_run(a)

        _lib.run = run  # (put back by the stand-in)
        q, k, v = qkv()
        new_empty = torch.Tensor.new_empty
        sizes = []
        torch.Tensor.new_empty = lambda self, *a, **kw: sizes.append((a, kw)) or new_empty(
            self, *a, **kw)
        try:
            sage_attn.scaled_dot_product_attention(q, k, v)
        finally:
            torch.Tensor.new_empty = new_empty
        assert stand.runs == 1 and stand.last_run.workspace_size == 257 and allocated[0]
        assert sizes == [(tuple(q.shape), {}), ((129,), {})]  # the output, the workspace


def test_direct_launch_without_a_kernel_runs_sdpa(monkeypatch):
    """A direct launch the library refuses runs torch's SDPA into the output, warning once."""
    monkeypatch.setattr(T, "_warned", set())
    with host.cuda_stand_in() as stand:
        def refuse(a):
            stand.runs += 1
            raise _lib.SageUnsupportedError(_lib.UNSUPPORTED, "refused")

        _lib.run = refuse  # (put back by the stand-in)
        q, k, v = qkv()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                o = sage_attn.scaled_dot_product_attention(q, k, v)
                assert torch.equal(o, q)  # (the stand-in SDPA answers its query)
        assert len(w) == 1 and "refused" in str(w[0].message)
        assert stand.runs == 2 and stand.sdpa == 2


def test_calls_under_the_least_routed_length_go_to_torch_unplanned(crossover_on):
    """Once a plan on the device has said its least routed length (sdpa_below), a plain 16-bit
    call with a shorter query goes to torch's SDPA without the signature; every other call
    (longer, a mask, dropout, fp32, a head dim the library never takes, the crossover off, a
    subclass) still takes the full decision, which also runs first on a device with no plan
    yet."""
    with host.cuda_stand_in(prefer_sdpa=lambda a: a.seq_q < 64, sdpa_below=64) as stand:
        short, longer = qkv((1, 4, 32, 64)), qkv((1, 4, 96, 64))
        dropin = sage_attn.scaled_dot_product_attention
        dropin(*short)  # no plan on the device yet: the full decision (torch), which plans
        assert stand.sdpa == 1 and stand.plans == 1 and len(T._routes) == 1
        T._routes.clear()
        for _ in range(3):
            dropin(*short)
        assert stand.sdpa == 4 and stand.plans == 1 and not T._routes  # unplanned, no lookup
        # dropin_backend answers as the drop-in runs: the shortcut's answer, no signature.
        assert T._dropin_route_of(*short, None, 0.0, False, None, False) is T._SHORT
        assert sage_attn.dropin_backend(*short) == "sdpa" and not T._routes
        dropin(*qkv((1, 4, 64, 64)))  # at the least routed length: the full decision (sage)
        assert stand.runs == 1 and stand.plans == 2 and len(T._routes) == 1
        T._routes.clear()
        stand.runs = 0
        dropin(*longer)  # at or above it: the full decision (sage here)
        assert stand.runs == 1 and len(T._routes) == 1
        T._routes.clear()
        mask = torch.zeros(32, 32, dtype=torch.float16)
        checks = []
        real = T._sdpa_unsupported
        T._sdpa_unsupported = lambda *a, **kw: checks.append(1) or real(*a, **kw)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dropin(*short, attn_mask=mask)
                dropin(*short, dropout_p=0.1)
                dropin(*qkv((1, 4, 32, 64), dtype=torch.float32))
                dropin(*qkv((1, 4, 32, 36)))  # D not a multiple of 8: the plan's to refuse
        finally:
            T._sdpa_unsupported = real
        assert len(checks) == 4 and stand.sdpa == 8  # each took the full decision: torch
        sage_attn.set_dropin_crossover(False)
        try:
            dropin(*short)
        finally:
            sage_attn.set_dropin_crossover(True)
        assert stand.runs == 2  # the crossover off: sage, however short
        # Malformed queries meet the full decision (and torch's own error), not an IndexError.
        checks.clear()
        T._sdpa_unsupported = lambda *a, **kw: checks.append(1) or real(*a, **kw)
        try:
            for bad in (torch.randn(32, dtype=torch.float16), torch.randn(4, 32, 64, 2, 2,
                                                                            dtype=torch.float16)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dropin(bad, bad, bad)
        finally:
            T._sdpa_unsupported = real
        assert len(checks) == 2


def test_a_gpu_never_measured_hands_every_call_to_torch(crossover_on, monkeypatch):
    """On a kind of GPU the crossover model has no measurements of, the plan prefers SDPA for
    every call and says so by an unbounded least routed length: the drop-in hands every call
    to torch, however long, warns once that the GPU was never measured (naming the switch),
    and after the first plan takes the length shortcut; with the crossover off it runs sage."""
    monkeypatch.setattr(T, "_warned", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with host.cuda_stand_in(prefer_sdpa=True, sdpa_below=T._NEVER_MEASURED) as stand:
        dropin = sage_attn.scaled_dot_product_attention
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for shape in ((1, 4, 96, 64), (1, 4, 96, 64), (1, 2, 4096, 128), (2, 8, 32, 64)):
                dropin(*qkv(shape))
        assert stand.sdpa == 4 and stand.runs == 0 and stand.plans == 1
        assert len(w) == 1, [str(x.message) for x in w]
        assert "sm_89" in str(w[0].message) and "set_dropin_crossover(False)" in str(w[0].message)
        assert T._dropin_route_of(*qkv((1, 2, 4096, 128)), None, 0.0, False, None,
                                  False) is T._SHORT
        sage_attn.set_dropin_crossover(False)
        dropin(*qkv((1, 4, 96, 64)))
        assert stand.runs == 1


def test_vmap_decides_in_the_op_per_slice(crossover_on):
    """Under torch.func.vmap the tensors have no storage to plan with: the drop-in leaves the
    choice to the op, which makes it per slice (torch's per-slice fallback): sage for each
    slice, or torch's SDPA for each where the model prefers it; nothing is cached."""
    x = torch.randn(3, 1, 2, 96, 64, dtype=torch.float16)
    for prefer in (False, True):
        with warnings.catch_warnings(), host.cuda_stand_in(prefer_sdpa=prefer) as stand:
            warnings.simplefilter("ignore")  # (torch's note that the op has no batching rule)
            stand_sdpa = T._torch_sdpa  # (returns its query: the op's output may not alias it)
            T._torch_sdpa = lambda *a, **kw: stand_sdpa(*a, **kw).clone()
            try:
                out = torch.vmap(lambda t: sage_attn.scaled_dot_product_attention(t, t, t))(x)
            finally:
                T._torch_sdpa = stand_sdpa
            assert out.shape == x.shape and not T._routes
            assert (stand.runs, stand.sdpa) == ((0, 3) if prefer else (3, 0))


def test_random_calls_get_the_answer_of_every_check(crossover_on):
    """Random calls around the least routed length, each asked through the signature (with the
    others cached) and with every check: the same answer, but that the shortcut's silent
    torch ("") may stand for a warning of the checks about the key, value or dimensions."""
    import random
    from fractions import Fraction
    rng = random.Random(30)
    rule = lambda a: a.seq_q < 64 or a.heads_kv != a.heads_q  # noqa: E731
    with host.cuda_stand_in(prefer_sdpa=rule, prefer_sdpa_training=lambda a: a.seq_q < 80,
                            has_backward=lambda a: a.head_dim == 64, sdpa_below=64), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = {(n, d): qkv((1, 4, n, d)) for n in (32, 63, 64, 96) for d in (64, 80)}
        calls = []
        for _ in range(300):
            n, d = rng.choice(list(base))
            q, k, v = base[n, d]
            if rng.random() < 0.2:
                q, k, v = (x.bfloat16() if rng.random() < 0.5 else x for x in (q, k, v))
            if rng.random() < 0.15:
                k, v = k[:, :2], v[:, :2]
            if rng.random() < 0.15:
                q = nhd(q)
            if rng.random() < 0.2:
                q, k, v = (x.clone().requires_grad_(rng.random() < 0.5) for x in (q, k, v))
            kw = {"is_causal": rng.random() < 0.5,
                  "scale": rng.choice([None, None, 0.125, 1, Fraction(1, 8), True, -1.0]),
                  "dropout_p": rng.choice([0.0, 0.0, 0, False, 0.1]),
                  "enable_gqa": rng.random() < 0.3}
            calls.append(((q, k, v), kw, rng.random() < 0.2, rng.random() < 0.1))
        for _ in range(2):  # the second round: each answer with the others cached
            for args, kw, no_grad, off in calls:
                sage_attn.set_dropin_crossover(not off)
                with torch.no_grad() if no_grad else contextlib.nullcontext():
                    got = T._dropin_route_of(*args, None, kw["dropout_p"], kw["is_causal"],
                                             kw["scale"], kw["enable_gqa"])
                    want = fresh(*args, **kw)
                got = "sage" if got.reason is None else got.reason
                if got == "" and want not in ("", "sage"):
                    q = args[0]
                    assert q.shape[2] < 64 and not off and not kw["dropout_p"]
                else:
                    assert got == want, (kw, no_grad, off, [x.dtype for x in args])
                sage_attn.set_dropin_crossover(True)


def test_flash_op_route_takes_the_same_shortcut():
    """The registered flash op's route (sage_attn._sdpa._route) hands a query shorter than the
    least routed length to torch's flash kernel without planning it, and plans a longer one."""
    from sage_attn import _sdpa
    with host.cuda_stand_in(prefer_sdpa=lambda a: a.seq_q < 64, sdpa_below=64) as stand:
        short, longer = qkv((1, 4, 32, 64)), qkv((1, 4, 96, 64))
        assert _sdpa._route(*longer, 0.0, False, None, False) == (_lib.MASK_NONE, 0.125)
        assert stand.plans == 1  # (which taught the device its least routed length)
        assert _sdpa._route(*short, 0.0, True, None, False) is None and stand.plans == 1
        sage_attn.set_dropin_crossover(False)
        try:
            assert _sdpa._route(*short, 0.0, True, None, False) == (
                _lib.MASK_CAUSAL_BOTTOM_RIGHT, 0.125)
        finally:
            sage_attn.set_dropin_crossover(True)
        assert stand.plans == 2
