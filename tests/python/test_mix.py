"""SageAttn-mix (sage_attn.mix): calibration on a random-init transformers Llama-style model
whose layers 2 and 5 get an outlier channel in K (a token-varying channel ten times the others:
smoothing K cannot remove it, and it sets the quantization scale of the whole K block), so their
quantized attention is measurably worse. CPU: the fast path is sage's CPU reference (8-bit by
default; the sm_89 pairing 4-bit/8-bit too), the accurate one torch's SDPA (or 8-bit).
Per-step sites on a function model and on a tiny diffusers Flux transformer. The GPU test
(skips without CUDA) uses the device's own pairing at real-ish size."""
import json
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import sage_attn  # noqa: E402
from sage_attn import mix  # noqa: E402

HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with sm_89 or newer")
BAD = (2, 5)


def _llama(seed, layers=8, hidden=64, heads=4, kv_heads=2, device="cpu", dtype=torch.float32):
    """A random-init Llama-style model whose layers BAD have peaked attention and an outlier
    channel in K."""
    transformers = pytest.importorskip("transformers")
    head_dim = hidden // heads
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=4096,
                                   attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # Scores of about a unit (q's std D^-1/4), as in trained models: the default init leaves
    # them near 0, attention almost uniform and Q·Kᵀ's quantization moot.
    qk = (head_dim ** -0.25) / (cfg.initializer_range * math.sqrt(hidden))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            a.q_proj.weight *= qk
            a.k_proj.weight *= qk
            if i in BAD:
                a.q_proj.weight *= 3.0  # peaked: scores 9x
                a.k_proj.weight *= 3.0
                for h in range(kv_heads):  # a token-varying K channel 10x the others
                    a.k_proj.weight[h * head_dim + 3] *= 10.0
    return model.to(device, dtype)


def _site(i):
    return f"model.layers.{i}.self_attn#0"


def _ids(rng, n, batch=2, seq=48, device="cpu"):
    return [torch.from_numpy(rng.integers(0, 256, (batch, seq))).to(device) for _ in range(n)]


@pytest.fixture
def counted(monkeypatch):
    """Wraps every path of mix._PATHS: calls[i] is (path name) of the i-th attention call."""
    calls = []
    for name, fn in list(mix._PATHS.items()):
        def spy(*args, _fn=fn, _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setitem(mix._PATHS, name, spy)
    return calls


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


PAIRINGS = pytest.mark.parametrize("paths", [None, ("sage4", "sage8")],
                                   ids=["default", "sm89-pairing"])


def _layers(sites):
    return sorted(int(s.split(".")[2]) for s in sites)


@PAIRINGS
def test_calibration_picks_the_outlier_layers(rng, paths):
    model = _llama(int(rng.integers(2**31)))
    fast, accurate = paths or (None, None)
    original = F.scaled_dot_product_attention
    plan = mix.calibrate(model, _ids(rng, 3), xi=0.25, fast=fast, accurate=accurate)
    assert F.scaled_dot_product_attention is original
    assert (plan.fast, plan.accurate) == (paths or ("sage8", "sdpa"))  # the CPU's pairing
    assert list(plan.routes) == [_site(i) for i in range(8)]
    acc = {i: plan.sites[_site(i)]["fast"]["accuracy"] for i in range(8)}
    print(plan.fast, {i: round(m["fast"]["rel_l1"], 4) for i, m in
                      enumerate(plan.sites.values())}, "chose", _layers(plan.accurate_sites))
    # The plan holds the ⌈0.25·8⌉ = 2 sites of lowest accuracy.
    assert _layers(plan.accurate_sites) == sorted(sorted(acc, key=acc.get)[:2])
    if paths:
        # 4-bit: the outlier layers are 3-10x worse than any other: exactly those.
        assert _layers(plan.accurate_sites) == list(BAD)
    else:
        # 8-bit barely minds them: layer 2 is worse than every clean layer but 0, whose
        # output (the average of uncorrelated embedding rows) is small beside its error.
        assert 2 in _layers(plan.accurate_sites)
        assert acc[2] < min(acc[i] for i in range(1, 8) if i not in BAD)
    for site, m in plan.sites.items():
        assert m["calls"] == 3  # one call a sample
        assert m["fast"]["accuracy"] < m["accurate"]["accuracy"]
        assert m["fast"]["accuracy_min"] <= m["fast"]["accuracy"]
    assert plan.meta["xi"] == 0.25 and plan.meta["device"] == "cpu"
    assert plan.meta["metric"] == "cos*(1-rel_l1)" and plan.meta["samples"] == 3
    assert plan.meta["sage_attn"] == sage_attn.__version__
    # ξ picks ⌈ξ·n⌉ from the same measurements: 0 none, 1/8 the worst, 1 all.
    assert plan.with_xi(0).accurate_sites == []
    assert plan.with_xi(0.125).accurate_sites == [_site(min(acc, key=acc.get))]
    assert len(plan.with_xi(0.13).accurate_sites) == 2
    assert len(plan.with_xi(1).accurate_sites) == 8


def test_plan_reloads_identically(rng, tmp_path):
    model = _llama(int(rng.integers(2**31)), layers=3)
    plan = mix.calibrate(model, _ids(rng, 1, seq=16), xi=0.34)
    path = tmp_path / "mix.json"
    plan.save(path)
    saved = json.loads(path.read_text())
    assert saved["routes"] == plan.routes and saved["format"] == mix.FORMAT
    again = mix.Plan.load(path)
    assert again == plan and again.to_dict() == plan.to_dict()
    assert again.accurate_sites == plan.accurate_sites and len(plan.accurate_sites) == 2
    assert again.with_xi(0.67) == plan.with_xi(0.67)


@PAIRINGS
def test_apply_routes_the_plan_and_recovers_accuracy(rng, counted, paths):
    model = _llama(int(rng.integers(2**31)))
    fast, accurate = paths or (None, None)
    plan = mix.calibrate(model, _ids(rng, 3), xi=0.25, fast=fast, accurate=accurate)
    chosen = _layers(plan.accurate_sites)
    (x,) = _ids(rng, 1)
    with torch.no_grad():
        ref = model.double()(x).logits  # full precision: the float64 model, torch's SDPA
        model.float()
        errors = {}
        for name, p in (("fast", plan.with_xi(0)), ("mix", plan), ("accurate", plan.with_xi(1))):
            counted.clear()
            with mix.apply(p, model) as routing:
                out = model(x).logits
            errors[name] = _rel(out, ref)
            if name == "mix":
                # Layer i makes the i-th call: the accurate path ran exactly for the chosen.
                assert [i for i, c in enumerate(counted) if c == plan.accurate] == chosen
                assert counted.count(plan.fast) == 6 and len(counted) == 8
                assert routing.counts == {"fast": 6, "accurate": 2}
                assert routing.seen == plan.routes
    recovered = (errors["fast"] - errors["mix"]) / (errors["fast"] - errors["accurate"])
    print(f"logits rel-L2 vs float64: all {plan.fast} {errors['fast']:.4f}, mix (layers "
          f"{chosen} on {plan.accurate}) {errors['mix']:.4f}, all {plan.accurate} "
          f"{errors['accurate']:.2e}; recovered {recovered:.0%}")
    assert errors["mix"] < errors["fast"]
    if paths:
        # Two of eight layers on 8-bit recover nearly all that 8-bit everywhere would; 8-bit's
        # own error on the other six is of the size of the noise, so the mix may come out ahead
        # of 8-bit everywhere (recovered over 100 %).
        assert recovered > 0.75, errors
    else:
        assert errors["accurate"] < errors["mix"]
        assert errors["accurate"] < 1e-4  # (torch's SDPA in float32 against float64)
        assert recovered > 0.2, errors  # (2 of 8 layers: more than a 1/4 share is not owed)


def test_sites_are_module_names_and_steps(rng, counted):
    # A model that calls SDPA twice in one module and runs three steps.
    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v) + F.scaled_dot_product_attention(
                q, k, v, is_causal=True)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def forward(self, q, k, v, bad_step=None):
            out = 0
            for t in range(3):
                with mix.step(t):
                    for i, b in enumerate(self.blocks):
                        kk = k
                        if (i, t) == bad_step:  # an outlier channel at block 1, step 2 only
                            kk = k.clone()
                            kk[..., 3] *= 50.0
                        out = out + b(q, kk, v)
            return out

    net = Net()
    qkv = [tuple(torch.from_numpy(rng.standard_normal((1, 2, 32, 16))).float() * 2
                 for _ in range(3)) for _ in range(2)]
    for q, _, _ in qkv:
        q[..., 3] = 0  # Q ignores the channel K's outlier takes: only its quantization suffers
    inputs = [(q, k, v, (1, 2)) for q, k, v in qkv]
    plan = mix.calibrate(net, inputs, xi=1 / 12)
    assert len(plan.routes) == 12  # 2 blocks x 2 calls x 3 steps
    assert "blocks.0#1@2" in plan.routes and "blocks.1#0@0" in plan.routes
    assert plan.accurate_sites[0].startswith("blocks.1#") and plan.accurate_sites[0].endswith("@2")
    assert len(plan.with_xi(2 / 12).accurate_sites) == 2
    both = plan.with_xi(2 / 12)
    assert set(both.accurate_sites) == {"blocks.1#0@2", "blocks.1#1@2"}
    counted.clear()
    with mix.apply(both, net) as routing:
        net(*qkv[0], (1, 2))
    order = [f"blocks.{i}#{j}@{t}" for t in range(3) for i in range(2) for j in range(2)]
    assert [s for s, c in zip(order, counted) if c == "sdpa"] == ["blocks.1#0@2", "blocks.1#1@2"]
    assert routing.counts == {"fast": 10, "accurate": 2}
    # A step never calibrated runs the fast path.
    with mix.apply(both, net) as routing:
        with mix.step(99):
            net.blocks[0](*qkv[0][:3])
    assert routing.counts == {"unplanned": 2}


def test_sites_without_a_module_and_outside_calls(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 24, 16))).float() for _ in range(3))
    q[..., 5] = 0  # K's outlier channel (x50) leaves the scores alone, not K's INT8 scale
    kb = k.clone()
    kb[..., 5] *= 50.0

    def f(x):  # a plain function: sites are the calls' indices within a pass
        return sum(F.scaled_dot_product_attention(q, kk, v) for kk in (k, kb, k))

    plan = mix.calibrate(f, [None, None], xi=0.3)
    assert list(plan.routes) == ["#0", "#1", "#2"] and plan.accurate_sites == ["#1"]
    with mix.apply(plan) as routing:
        f(None)
    assert routing.seen == plan.routes
    # With a module, calls outside it are not sites: they run what was there before.
    lin = torch.nn.Linear(4, 4)
    with mix.apply(mix.Plan({"(root)#0": "accurate"}, "sage8", "sdpa"), lin) as routing:
        F.scaled_dot_product_attention(q, k, v)
    assert routing.counts == {}


def test_diffusers_flux_per_step(rng, counted):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(int(rng.integers(2**31)))
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8]).eval()

    def sample():
        return dict(hidden_states=torch.randn(1, 36, 8),
                    encoder_hidden_states=torch.randn(1, 8, 32),
                    pooled_projections=torch.randn(1, 32),
                    img_ids=torch.randint(0, 6, (36, 3)).float(), txt_ids=torch.zeros(8, 3))

    class Pipe:  # what diffusers_step reads of a pipeline
        num_timesteps = 3

    def denoise(**x):  # a 3-step loop calling the callback after each step, as pipelines do
        h = x["hidden_states"]
        for i, t in enumerate((1.0, 0.6, 0.2)):
            h = h - 0.3 * model(**dict(x, hidden_states=h), timestep=torch.tensor([t]),
                                return_dict=False)[0]
            mix.diffusers_step(Pipe, i, t, {})
        return h

    plan = mix.calibrate(denoise, [sample(), sample()], modules=model, xi=0.5)
    blocks = ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]
    # The first step is keyless, then its index.
    assert sorted(plan.routes) == sorted(f"{b}#0{s}" for b in blocks for s in ("", "@1", "@2"))
    assert len(plan.accurate_sites) == 3
    with torch.no_grad():
        counted.clear()
        with mix.apply(plan, model) as routing:
            denoise(**sample())
            denoise(**sample())  # the callback's reset after the last step: same keys again
    assert routing.seen == plan.routes and routing.counts == {"fast": 6, "accurate": 6}
    assert counted.count("sdpa") == 6 and counted.count("sage8") == 6


def test_bad_arguments():
    lin = torch.nn.Linear(2, 2)
    for xi in (10, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="xi"):
            mix.calibrate(lin, [torch.zeros(2)], xi=xi)
    with pytest.raises(ValueError, match="reduce"):
        mix.calibrate(lin, [torch.zeros(2)], reduce="max")
    with pytest.raises(ValueError, match="fast"):
        mix.calibrate(lin, [torch.zeros(2)], fast="int3")
    with pytest.raises(TypeError, match="inputs"):
        mix.calibrate(lin, torch.zeros(2))
    with pytest.raises(ValueError, match="inputs"):
        mix.calibrate(lin, [])
    with pytest.raises(TypeError, match="modules"):
        mix.calibrate(lambda x: x, [1], modules=3)
    with pytest.raises(RuntimeError, match="no torch.nn.functional"):
        mix.calibrate(lin, [torch.zeros(2)])  # no attention at all
    with pytest.raises(TypeError, match="step"):
        mix.set_step(object())
    plan = mix.Plan({"layers.0#0": "accurate"}, "sage8", "sdpa")
    with pytest.raises(ValueError, match="model"):
        with mix.apply(plan):
            pass
    with pytest.raises(ValueError, match="layers.0"):
        with mix.apply(plan, lin):
            pass
    with pytest.raises(TypeError, match="plan"):
        with mix.apply({"routes": {}}):
            pass
    with pytest.raises(ValueError, match="routes"):
        mix.Plan({"a#0": "slow"}, "sage8", "sdpa")
    with pytest.raises(ValueError, match="format"):
        mix.Plan.from_dict({"routes": {}})
    original = F.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="nested"):
        with mix.apply(mix.Plan({}, "sage8", "sdpa")):
            with mix.apply(mix.Plan({}, "sage8", "sdpa")):
                pass
    assert F.scaled_dot_product_attention is original
    with pytest.raises(KeyError):
        with mix.apply(mix.Plan({}, "sage8", "sdpa")):
            raise KeyError("inside")
    assert F.scaled_dot_product_attention is original


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("not json")
    with pytest.raises(ValueError, match="path"):
        mix.Plan.load(p)
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format"):
        mix.Plan.load(p)


def test_default_paths_by_device():
    assert mix.default_paths("cpu") == ("sage8", "sdpa")
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        want = ("sage4", "sage8") if cc == (8, 9) or cc[0] == 12 else ("sage8", "sdpa")
        assert mix.default_paths("cuda") == want


@gpu
@PAIRINGS
def test_gpu_llama_real_size(rng, paths):
    # Llama-style dims (hidden 2048, 16 heads of 128, 8 KV heads), 8 layers, bf16, 2 x 1024
    # tokens; layers 2 and 5 made hard as on the CPU. "default": the device's own pairing (on
    # Hopper 8-bit against torch's SDPA, on sm_89/sm_120 4-bit against 8-bit); the sm_89
    # pairing runs on any GPU (4-bit on the mma.sync kernel: slow on Hopper, but the same
    # arithmetic).
    model = _llama(int(rng.integers(2**31)), hidden=2048, heads=16, kv_heads=8,
                   device="cuda", dtype=torch.bfloat16)
    fast, accurate = paths or (None, None)
    sage_attn.set_dropin_crossover(False)  # sage on every shape: the fast path is measured
    try:
        plan = mix.calibrate(model, _ids(rng, 2, seq=1024, device="cuda"), xi=0.25, fast=fast,
                             accurate=accurate)
        acc = {i: plan.sites[_site(i)]["fast"]["accuracy"] for i in range(8)}
        print(plan, plan.meta, {i: round(m["fast"]["rel_l1"], 4) for i, m in
                                enumerate(plan.sites.values())})
        assert (plan.fast, plan.accurate) == (paths or mix.default_paths("cuda"))
        assert _layers(plan.accurate_sites) == sorted(sorted(acc, key=acc.get)[:2])
        if plan.fast == "sage4":
            # The outlier layers are worse than every clean layer but 0, whose output (the
            # average of uncorrelated embedding rows) is small beside its 4-bit error: at this
            # size it can rank between them, so the plan holds outlier layers and at most layer 0.
            assert max(acc[i] for i in BAD) < min(acc[i] for i in range(1, 8) if i not in BAD)
            assert set(_layers(plan.accurate_sites)) <= {0, *BAD}
        (x,) = _ids(rng, 1, seq=1024, device="cuda")
        with torch.no_grad():
            ref = model.float()(x).logits.double()  # float32 model: the full-precision logits
            model.bfloat16()
            errs = {}
            for name, p in (("fast", plan.with_xi(0)), ("mix", plan),
                            ("accurate", plan.with_xi(1))):
                with mix.apply(p, model) as routing:
                    errs[name] = _rel(model(x).logits, ref)
                assert routing.counts["unplanned"] == 0 and sum(routing.counts.values()) == 8
        recovered = (errs["fast"] - errs["mix"]) / (errs["fast"] - errs["accurate"])
        print(f"logits rel-L2 vs float32: {errs}; chose {_layers(plan.accurate_sites)}, "
              f"recovered {recovered:.0%}")
        assert errs["mix"] < errs["fast"]
    finally:
        sage_attn.set_dropin_crossover(True)
