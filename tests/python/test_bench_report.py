"""The benchmark's report code (sage_attn._bench_common): command line, JSON rows, the tables
the bar is read from, the plot. No torch or GPU needed: synthetic rows."""
import json
import types

import pytest

from sage_attn import _bench_common as bc


def synthetic_rows():
    rows = []
    for causal in (False, True):
        for n in (1024, 4096):
            def row(impl, **figures):
                r = bc.new_row(impl, 128, n, 4, 32, causal)
                r.update(figures)
                rows.append(r)
            row("sage-8b", e2e_tops=500.0 + n / 64, graph_tops=600.0 + n / 64, kernel_tops=900.0,
                ms=1.0, cos=0.999, rel_l1=0.038, rmse=0.01, max_abs=0.1, host_us=42.4)
            row("sdpa-cudnn", e2e_tops=420.0, graph_tops=585.0, ms=1.0, rel_l1=0.0003,
                host_us=30.0)
            row("cudnn-fp8", kernel_tops=550.0 if n == 1024 else 941.0, graph_tops=560.0,
                ms=0.5, rel_l1=0.059)
            row("sdpa-dropin", e2e_tops=400.0, graph_tops=590.0, host_us=50.0,
                choice="sdpa" if n == 1024 else "sage")
    rows.append(bc.new_row("sdpa-flash", 128, 1024, 4, 32, False))  # a row that did not run
    return rows


def test_parse_args_defaults():
    a = bc.parse_args([])
    assert a.dims == [64, 128]
    assert a.seqs == [1024, 2048, 4096, 8192, 16384, 32768]
    assert a.causals == [False, True]
    assert a.impls == bc.DEFAULT_IMPLS.split(",")
    assert set(a.impls) <= set(bc.IMPLS)
    assert "cudnn-fp8" in a.impls and "sdpa-dropin" in a.impls
    assert not a.no_graph and not a.no_host
    assert not a.host_time and a.host_rounds == 200 and a.host_calls == 5


def test_parse_args_values():
    a = bc.parse_args(["--dims", "128", "--seqs", "1024,4096", "--causal", "1", "--impls",
                       "sage-8b-mma,cudnn-fp8", "--no-graph", "--seconds", "0.1"])
    assert a.dims == [128] and a.seqs == [1024, 4096] and a.causals == [True]
    assert a.impls == ["sage-8b-mma", "cudnn-fp8"] and a.no_graph and a.seconds == 0.1
    # The wide head dims (the library says which run; the bench passes any on).
    assert bc.parse_args(["--dims", "192,256"]).dims == [192, 256]


@pytest.mark.parametrize("argv", [["--impls", "sage-9b"], ["--dims", "64,x"], ["--seqs", "0"],
                                  ["--causal", "2"], ["--seconds", "0"], ["--batch", "0"],
                                  ["--host-rounds", "0"], ["--host-calls", "0"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bc.parse_args(argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_flops_and_tops():
    assert bc.flops(4, 32, 1024, 128, False) == 4.0 * 4 * 32 * 1024 * 1024 * 128
    assert bc.flops(4, 32, 1024, 128, True) == bc.flops(4, 32, 1024, 128, False) / 2
    assert bc.tops(1e12, 1.0) == 1000.0  # 1e12 FLOPs in 1 ms
    assert bc.tops(1e12, None) is None and bc.tops(1e12, 0.0) is None


def test_json_schema(tmp_path):
    rows = synthetic_rows()
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580", "cuda": "13.0", "torch": "2.11",
            "commit": "abc", "date": "2026-11-25", "input": "normal"}
    path = tmp_path / "r.json"
    bc.write_json(path, meta, rows)
    doc = json.loads(path.read_text())
    for k in ("gpu", "driver", "cuda", "torch", "commit", "date"):
        assert doc[k] == meta[k]
    assert len(doc["rows"]) == len(rows)
    for r in doc["rows"]:
        assert list(r) == list(bc.ROW_FIELDS)  # every field, in order, null where it does not apply
    fp8 = next(r for r in doc["rows"] if r["impl"] == "cudnn-fp8")
    assert fp8["e2e_tops"] is None and fp8["kernel_tops"] == 550.0 and fp8["host_us"] is None
    dropin = [r["choice"] for r in doc["rows"] if r["impl"] == "sdpa-dropin"]
    assert set(dropin) == {"sage", "sdpa"}
    flash = next(r for r in doc["rows"] if r["impl"] == "sdpa-flash")
    assert all(flash[k] is None for k in ("e2e_tops", "graph_tops", "ms", "cos", "choice"))
    # One row per line, so result files diff line by line.
    assert path.read_text().count("\n") == len(rows) + 2


def test_summary_row_is_min_of_anchors():
    rows = synthetic_rows()
    s = bc.summary_row(rows, 128, False, 1024)
    assert s["R"] == 550.0  # cuDNN FP8 kernel-only below SDPA cuDNN graph (585)
    assert s["ratio"] == pytest.approx(s["sage_graph"] / 550.0)
    assert s["choice"] == "sdpa" and s["sage_host_us"] == 42.4 and s["cudnn_host_us"] == 30.0
    s = bc.summary_row(rows, 128, False, 4096)
    assert s["R"] == 585.0 and s["choice"] == "sage"
    empty = bc.summary_row(rows, 64, False, 1024)  # no rows at all: all missing, no crash
    assert empty["R"] is None and empty["ratio"] is None


def test_summary_row_with_one_anchor_missing():
    rows = [r for r in synthetic_rows() if r["impl"] != "cudnn-fp8"]
    assert bc.summary_row(rows, 128, True, 4096)["R"] == 585.0


def test_summary_table():
    text = bc.summary_table(synthetic_rows())
    lines = text.splitlines()
    assert lines[0].startswith("| D | causal | N | sage graph | sage eager | cuDNN fp16 graph")
    assert "R" in lines[0] and "sage graph / R" in lines[0] and "drop-in" in lines[0]
    ncols = lines[0].count("|")
    assert all(line.count("|") == ncols for line in lines)
    assert len(lines) == 2 + 4  # header, rule, (causal x N)
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first[:3] == ["128", "no", "1k"]
    assert first[3] == "616" and first[7] == "550" and first[8] == "550"
    assert first[9] == f"{616 / 550:.2f}" and first[10] == "42" and first[11] == "30"
    assert first[12] == "sdpa"


def test_impl_table():
    text = bc.impl_table(synthetic_rows())
    lines = text.splitlines()
    assert "cudnn-fp8" in lines[0] and "sage-8b rel-L1" in lines[0]
    ncols = lines[0].count("|")
    assert all(line.count("|") == ncols for line in lines)
    assert "(550)" in lines[2]  # kernel-only figure in brackets
    assert "616 / 516 (900)" in lines[2]  # graph / eager (kernel-only)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    assert bc.plot(synthetic_rows(), path, "synthetic")
    assert path.stat().st_size > 1000


def test_bench_models_table_is_well_formed():
    """The real-model shape table: every call is one the library's GPU kernels take (head dims a
    multiple of 8 up to 256, whole GQA groups) and is named once."""
    from sage_attn.bench_models import MODELS
    calls = [m[1] for m in MODELS]
    assert len(calls) == len(set(calls))
    for model, call, b, hq, hkv, n, d, causal in MODELS:
        assert b >= 1 and n >= 1 and hq % hkv == 0, call
        assert d % 8 == 0 and 8 <= d <= 256, call
        assert isinstance(causal, bool), call


def test_bench_models_more_calls_and_own_calls():
    """--set more: calls named once, none already in the README's table, the library's head dims
    and GQA groups, causal only where Nq = Nk. --calls parses label:B:Hq:Hkv:Nq:Nk:D:causal and
    names what is wrong with a bad item."""
    from sage_attn.bench_models import MODELS, MORE_CALLS, _table, parse_calls
    calls = [m[1] for m in MORE_CALLS]
    assert len(calls) == len(set(calls)) and not set(calls) & {m[1] for m in MODELS}
    shapes = {m[2:] for m in _table("table")}
    for model, call, b, hq, hkv, nq, nk, d, causal in MORE_CALLS:
        assert (b, hq, hkv, nq, nk, d, causal) not in shapes, call
        assert min(b, nq, nk) >= 1 and hq % hkv == 0, call
        assert d % 8 == 0 and 8 <= d <= 256, call
        assert isinstance(causal, bool) and (not causal or nq == nk), call
    assert len(_table("all")) == len(MODELS) + len(MORE_CALLS)
    got = parse_calls(" a:2:16:16:4096:77:72:0 ; lm:1:32:8:2048:2048:128:1;")
    assert got == (("a", "a", 2, 16, 16, 4096, 77, 72, False),
                   ("lm", "lm", 1, 32, 8, 2048, 2048, 128, True))
    for bad, what in (("a:2:16:16:4096:77:72", "label:B:Hq:Hkv:Nq:Nk:D:causal"),
                      ("a:2:16:x:4096:77:72:0", "integers"),
                      ("a:2:16:6:4096:4096:72:0", "multiple"),
                      ("a:2:16:16:4096:77:72:1", "Nq = Nk"),
                      ("a:0:16:16:4096:77:72:0", "sizes >= 1")):
        with pytest.raises(ValueError, match=what):
            parse_calls(bad)


def test_pair_circuit_puts_every_ordered_pair_side_by_side_once():
    pytest.importorskip("torch")
    from sage_attn import bench
    assert bench.pair_circuit(1) == [0]
    for n in range(2, 8):
        c = bench.pair_circuit(n)
        pairs = [(c[i], c[(i + 1) % len(c)]) for i in range(len(c))]
        assert len(c) == n * (n - 1)
        assert sorted(pairs) == [(u, v) for u in range(n) for v in range(n) if u != v]


def test_interleaved_ms_alternates_and_takes_medians(monkeypatch):
    """The implementations' graphs are replayed in the order of pair_circuit (each follows every
    other once a circuit), each replay between its own events, the circuits queued in `rounds`
    batches, each batch led by an untimed replay of the circuit's last implementation and read
    after a synchronize; an implementation's figure is the median over circuits of the mean of
    its replays' times (over the calls in its graph); one whose capture fails is reported and
    gets None, the others still run."""
    pytest.importorskip("torch")
    from sage_attn import bench
    log, clock = [], [0.0]
    # a: 2 replays a circuit; circuit means 2, 1, 5, 2 -> median 2 (1 over 2 calls a replay)
    cost = {"a": [3.0, 1.0, 1.0, 1.0, 9.0, 1.0, 2.0, 2.0],
            "b": [10.0, 30.0, 20.0, 20.0, 20.0, 40.0, 10.0, 10.0],
            "c": [4.0] * 8}

    def capture(fn, est):
        name = fn()
        if name == "bad":
            raise RuntimeError("capture failed\nmore")
        assert est == 1.0

        def replay():
            log.append(name)
            if clock_on[0]:
                clock[0] += cost[name].pop(0)
        return types.SimpleNamespace(replay=replay), 2  # 2 calls a replay

    clock_on = [False]

    class Event:
        def record(self):
            clock_on[0] = True
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    def sync():
        log.append("sync")
        clock_on[0] = False

    monkeypatch.setattr(bench, "capture_graph", capture)
    monkeypatch.setattr(bench, "time_ms", lambda fn, target_s=0.25, samples=5: 1.0)
    reports = []
    # 0.016 s over 2 rounds at 2 ms a replay and 2 replays an implementation a circuit:
    # 2 circuits a round
    got = bench.interleaved_ms({"a": lambda: "a", "bad": lambda: "bad", "b": lambda: "b",
                                "c": lambda: "c"}, 0.016, 2, reports.append, event=Event,
                               sync=sync)
    circuit = [["a", "b", "c"][i] for i in bench.pair_circuit(3)]
    assert log == ([circuit[-1]] + circuit * 2 + ["sync"]) * 2
    # b: circuit means 20, 20, 30, 10 -> 20; c: 4
    assert got == {"a": 1.0, "bad": None, "b": 10.0, "c": 2.0}
    assert reports == ["bad failed (RuntimeError: capture failed)"]
    assert all(not c for c in cost.values())


def test_paired_host_us_holds_rotates_and_pairs():
    """--host-time's timing: each round holds the GPU, times a batch of calls of each function
    (the order rotated by round), then synchronizes; per-call microseconds a round, and the
    per-round difference to the base read pair by pair."""
    pytest.importorskip("torch")
    from sage_attn import bench
    now, log = [0.0], []
    cost = {"a": 2e-6, "b": 5e-6, "c": 1e-6}

    def fn(name):
        def call():
            log.append(name)
            now[0] += cost[name]
        return call

    times = bench.paired_host_us({n: fn(n) for n in cost}, rounds=3, calls=4,
                                 hold=lambda: log.append("hold"), sync=lambda: log.append("sync"),
                                 clock=lambda: now[0])
    rounds = [["hold"] + [n for n in order for _ in range(4)] + ["sync"]
              for order in (("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"))]
    assert log == [x for r in rounds for x in r]
    assert {n: [round(t, 6) for t in ts] for n, ts in times.items()} == {
        "a": [2.0] * 3, "b": [5.0] * 3, "c": [1.0] * 3}
    times["b"] = [5.0, 9.0, 6.0]
    assert bench.paired_summary(times, "b", "a") == pytest.approx((6.0, 4.0, 3.0, 7.0))


def test_grid_graph_column_times_a_shapes_rows_together(monkeypatch):
    """The grid's graph column: the implementations of one shape that ran (a graph call each)
    timed together by interleaved_ms; a row that did not run, or is timed as a kernel alone, is
    not timed and keeps a null column, and so does one whose capture failed."""
    pytest.importorskip("torch")
    from sage_attn import bench
    seen = {}

    def interleaved(fns, target_s, rounds, report):
        seen.update(fns)
        report("sdpa-flash failed (RuntimeError: capture)")
        return {"sage-8b": 2.0, "sdpa-cudnn": 4.0, "sdpa-flash": None}

    monkeypatch.setattr(bench, "interleaved_ms", interleaved)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    q = types.SimpleNamespace(shape=(4, 32, 1024, 128))
    rows = [(bc.new_row(name, 128, 1024, 4, 32, False), fn) for name, fn in
            (("sage-8b", "f1"), ("sdpa-cudnn", "f2"), ("sdpa-flash", "f3"), ("cudnn-fp8", None))]
    bench.graph_rows(rows, q, False, types.SimpleNamespace(seconds=0.3))
    assert seen == {"sage-8b": "f1", "sdpa-cudnn": "f2", "sdpa-flash": "f3"}
    fl = bc.flops(4, 32, 1024, 128, False)
    got = {row["impl"]: row["graph_tops"] for row, _ in rows}
    assert got == {"sage-8b": bc.tops(fl, 2.0), "sdpa-cudnn": bc.tops(fl, 4.0),
                   "sdpa-flash": None, "cudnn-fp8": None}
