"""python -m sage_attn.bench_flux on the CPU: a few-parameter Flux transformer through the three
modes (torch's SDPA, the drop-in, the drop-in with its crossover off), the table and the JSON;
arguments out of range refused by name. (On the GPU it runs the real config; the drop-in hands
CPU tensors to torch, so here the modes agree.)"""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from sage_attn import bench_flux  # noqa: E402


def test_cpu_tiny_model_runs_every_mode(tmp_path, capsys):
    status = bench_flux.main(["--device", "cpu", "--tiny", "--double", "1", "--single", "2",
                              "--image-tokens", "16", "--text-tokens", "4", "--seconds", "0.01",
                              "--out", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "| sdpa |" in out and "| drop-in |" in out and "| sage-all |" in out, out
    files = list(tmp_path.glob("*-cpu-flux-model.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert [r["mode"] for r in data["rows"]] == ["sdpa", "drop-in", "sage-all"]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] is None for r in data["rows"])
    assert data["rows"][0]["speed_eager"] == 1.0
    assert data["meta"]["config"]["num_layers"] == 1
    assert data["meta"]["config"]["num_single_layers"] == 2
    assert data["meta"]["dropin_choice"] == "sdpa"  # CPU tensors: torch's


def test_cpu_model_outputs_agree_across_modes():
    # The modes run the same step: on CPU tensors the drop-in hands every call to torch.
    cfg = dict(bench_flux.FLUX_TINY, num_layers=1, num_single_layers=1)
    model = bench_flux.build(cfg, "cpu", torch.float32)
    x = bench_flux.inputs(cfg, 16, 4, "cpu", torch.float32, seed=3)
    with torch.no_grad():
        outs = {name: fn() for name, fn in bench_flux.modes(model, x).items()}
    assert outs["sdpa"].shape == (1, 16, cfg["in_channels"])
    assert torch.equal(outs["sdpa"], outs["drop-in"]) and torch.equal(outs["sdpa"], outs["sage-all"])


@pytest.mark.parametrize("args,name", [(["--image-tokens", "15"], "--image-tokens"),
                                       (["--rounds", "0"], "--rounds"),
                                       (["--double", "-1"], "--double")])
def test_bad_arguments_are_refused_by_name(args, name, capsys):
    with pytest.raises(SystemExit) as e:
        bench_flux.main(["--device", "cpu", "--tiny"] + args)
    assert e.value.code == 2
    assert name in capsys.readouterr().err
