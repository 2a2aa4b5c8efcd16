"""The benchmark harness on CPU: FLOP and byte formulas, the CSV schema, speedups, and a real
quick run of each family writing a CSV whose rows pass the k× check."""

import csv
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import harness
import report


def test_attention_flops():
    # Two matmuls of 2·Tq·Tk·D per head: 4·B·H·Tq·Tk·D.
    assert harness.attention_flops(2, 3, 5, 7, 11) == 4 * 2 * 3 * 5 * 7 * 11
    assert harness.attention_flops(1, 1, 8, 8, 4, causal=True) == 4 * 8 * 8 * 4 / 2
    assert harness.attention_flops(1, 1, 8, 8, 4, mode="bwd") == 2.5 * 4 * 8 * 8 * 4
    assert harness.attention_flops(1, 1, 8, 8, 4, mode="fwd+bwd") == 3.5 * 4 * 8 * 8 * 4
    assert harness.tflops(1e12, 1000.0) == pytest.approx(1.0)


def test_rowwise_bytes_read_each_input_once_and_write_each_output_once():
    M, N, size = 10, 100, 2
    assert harness.rowwise_bytes(M, N, size) == 2 * M * N * size
    assert harness.rowwise_bytes(M, N, size, mode="bwd") == 3 * M * N * size
    ln_fwd = harness.rowwise_bytes(M, N, size, param_vectors=2, stat_bytes_per_row=8)
    assert ln_fwd == 2 * M * N * size + 2 * N * size
    ln_bwd = harness.rowwise_bytes(M, N, size, mode="bwd", param_vectors=2, stat_bytes_per_row=8)
    # reads x, dy, w, b, mean, rstd; writes dx, dw, db
    assert ln_bwd == 3 * M * N * size + 4 * N * size + 8 * M
    both = harness.rowwise_bytes(M, N, size, mode="fwd+bwd", param_vectors=2, stat_bytes_per_row=8)
    assert both == ln_fwd + ln_bwd
    assert harness.gbps(1e9, 1000.0) == pytest.approx(1.0)


def test_schema_has_the_design_columns_and_rejects_unknown_fields(tmp_path):
    design = [
        "op",
        "impl",
        "dtype",
        "B",
        "H",
        "Tq",
        "Tk",
        "D",
        "N",
        "causal",
        "mask",
        "pass",
        "ms",
        "tflops",
        "gbps",
        "peak_mem_mb",
        "speedup_vs_naive",
        "device",
        "torch",
        "triton",
        "cuda",
        "git_sha",
        "date",
    ]
    assert set(design) <= set(harness.COLUMNS)
    env = harness.environment()
    assert env["torch"] == torch.__version__ and env["date"]
    row = harness.make_row(env, op="softmax", mode="fwd", impl="naive", ms=1.23456789)
    assert row["ms"] == 1.2346 and row["device"] == env["device"] and row["N"] == ""
    with pytest.raises(KeyError, match="not in the CSV schema"):
        harness.make_row(env, op="softmax", speed=3)
    path = harness.write_csv([row], tmp_path / "x.csv")
    back = harness.read_csv(path)
    assert list(back[0]) == harness.COLUMNS and back[0]["impl"] == "naive"


def test_speedup_is_naive_time_over_impl_time_for_the_same_case():
    env = {"device": "cpu"}
    rows = [
        harness.make_row(env, op="softmax", mode="fwd", impl="naive", N=8, ms=4.0),
        harness.make_row(env, op="softmax", mode="fwd", impl="torch", N=8, ms=1.0),
        harness.make_row(env, op="softmax", mode="fwd", impl="torch", N=16, ms=1.0),
    ]
    harness.add_speedups(rows)
    assert [r["speedup_vs_naive"] for r in rows] == [1.0, 4.0, ""]


def test_correctness_verdict():
    ref = torch.randn(8, dtype=torch.float64)
    assert harness.correctness(ref.float(), ref, ref.float()) == "yes"
    assert harness.correctness(ref.float() + 1, ref, ref.float()).startswith("no: ")


def test_device_slug():
    assert harness.device_slug({"device": "NVIDIA H200"}) == "nvidia-h200"
    assert harness.device_slug({"device": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100"
    assert harness.device_slug({"device": "cpu"}) == "cpu"


@pytest.mark.slow
def test_run_all_quick_writes_every_family_and_every_row_passes(tmp_path, capsys):
    import run_all

    # The CPU path always: on a GPU machine the GPU suite is gpu-check's bench step.
    kernels = "attention,layernorm,rmsnorm,softmax"
    assert (
        run_all.main(["--quick", "--device", "cpu", "--only", kernels, "--out", str(tmp_path)]) == 0
    )
    text = capsys.readouterr().out
    assert "Summary" in text
    for name in ("attention", "layernorm", "rmsnorm", "softmax"):
        rows = harness.read_csv(tmp_path / f"{name}.csv")
        assert rows and all(r["pass"] == "yes" for r in rows)
        assert {r["mode"] for r in rows} == {"fwd", "bwd", "fwd+bwd"}
        assert all(float(r["ms"]) > 0 for r in rows)
        assert any(r["speedup_vs_naive"] not in ("", "1.0") for r in rows)
    assert "reduced CPU suite" in text
    assert "fusedattn-cuda not measured" in text


def test_run_all_fp8_family_on_the_cpu(tmp_path, monkeypatch):
    """The fp8 family (issue #60) in its CPU smoke form: decode rows over a contiguous and a
    paged fp8 cache and forward rows, every row passing the k× check against float64 on the
    dequantized values; and with the Triton kernels (through the interpreter here) each fp8
    row says its speed against its bf16 twin's, as the GPU run's rows will."""
    import bench_fp8
    import run_all

    assert run_all.main(["--device", "cpu", "--only", "fp8", "--out", str(tmp_path),
                         "--no-plots"]) == 0  # fmt: skip
    rows = harness.read_csv(tmp_path / "fp8.csv")
    assert all(r["pass"] == "yes" for r in rows)
    decode = [r for r in rows if r["op"] == "decode"]
    assert {r["mask"] for r in decode} == {"contiguous", "paged16"}
    assert {"fusedattn-torch-fp8", "fusedattn-torch"} <= {r["impl"] for r in decode}
    forward = [r for r in rows if r["op"] == "attention"]
    assert {r["mask"] for r in forward} == {"fp8"} and float(forward[0]["tflops"]) > 0
    if not os.environ.get("TRITON_INTERPRET"):
        return
    monkeypatch.setattr(harness, "kernel_backends", lambda op, device: ["triton"])
    monkeypatch.setattr(harness, "time_stats", lambda fn, device, reps=1: (fn(), (1.0, 0.0))[1])
    env = harness.environment(torch.device("cpu"))
    rows = bench_fp8.forward_rows(True, torch.device("cpu"), env)[:2]
    assert [r["impl"] for r in rows] == ["fusedattn-triton", "fusedattn-triton-fp8"]
    assert all(r["pass"] == "yes" for r in rows) and "the bf16 kernel's speed" in rows[1]["note"]


def test_run_all_decode_family_on_the_cpu(tmp_path, capsys):
    """The decode family (issue #32) on the CPU: the torch backend and the baselines over a
    contiguous and a paged cache, every row passing the k× check, GB/s of K/V read, and the
    generate rows in tokens/s; fusedattn's kernels not measured, said once."""
    import run_all

    assert run_all.main(["--device", "cpu", "--only", "decode", "--out", str(tmp_path)]) == 0
    rows = harness.read_csv(tmp_path / "decode.csv")
    decode = [r for r in rows if r["op"] == "decode"]
    assert decode and all(r["pass"] == "yes" and float(r["gbps"]) > 0 for r in decode)
    assert {r["mask"] for r in decode} == {"contiguous", "paged16"}
    assert {r["impl"] for r in decode} >= {"fusedattn-torch", "sdpa", "naive"}
    generate = [r for r in rows if r["op"] == "generate"]
    assert {r["impl"] for r in generate} == {
        "sdpa",
        "fusedattn",
        "sdpa-static-compiled",
        "fusedattn-static-compiled",
    }
    assert all(float(r["tokens_per_s"]) > 0 for r in generate)
    text = capsys.readouterr().out
    assert text.count("fusedattn-triton not measured") == 1  # once, for every op
    assert (tmp_path / "decode.png").exists()


ON_GPU_THE_BENCH_RUNS = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the benchmark runs these paths itself"
)


@pytest.mark.slow
@ON_GPU_THE_BENCH_RUNS
def interpreter_sized(case):
    """A bench_attention case the interpreter runs in seconds: 96 tokens (a whole and a cut
    tile), head dim 16; what the rows test is the harness's paths, not the kernels."""
    return dataclasses.replace(case, T=min(case.T, 96), D=16)


def test_window_and_varlen_rows_run_the_kernel_paths(tmp_path, monkeypatch):
    """The GPU-only fusedattn rows of the variant cases, run here through the interpreter so a
    GPU session does not find their bugs: window_size and the same window as a dense mask,
    varlen_attention on packed tokens, softcap; every row passes the k× check."""
    import bench_attention

    monkeypatch.setattr(harness, "kernel_backends", lambda op, device: ["triton"])
    monkeypatch.setattr(harness, "time_stats", lambda fn, device, reps=1: (fn(), (1.0, 0.0))[1])
    variants = [
        interpreter_sized(c)
        for c in bench_attention.cases(True, torch.device("cpu"))
        if c.mask in ("window", "varlen", "softcap")
    ]
    monkeypatch.setattr(bench_attention, "cases", lambda quick, device: variants)
    rows = bench_attention.run(True, torch.device("cpu"), {"device": "cpu"})
    impls = {(r["mask"], r["impl"]) for r in rows}
    assert {("window", "fusedattn-triton"), ("window", "fusedattn-triton+dense"),
            ("varlen", "fusedattn-triton"), ("varlen", "sdpa"), ("softcap", "naive"),
            ("softcap", "fusedattn-triton")} <= impls  # fmt: skip
    assert not any(r["mask"] == "softcap" and r["impl"].startswith("sdpa") for r in rows)
    assert all(r["pass"] == "yes" for r in rows), [r for r in rows if r["pass"] != "yes"]
    window = [r for r in rows if r["mask"] == "window" and r["mode"] == "fwd"]
    assert len({r["tflops"] for r in window}) == 1  # one FLOP count (the window's) for all


def test_timing_reports_the_spread_and_flags_noisy_rows(monkeypatch):
    ms, spread = harness.time_stats(lambda: sum(range(1000)), device=torch.device("cpu"))
    assert ms > 0 and spread >= 0
    assert harness._spread([1.0, 1.0, 2.0]) == 1.0
    assert harness.noisy(0.1) == "" and "NOISY" in harness.noisy(harness.NOISY_SPREAD + 0.01)
    # a warm-up call, then repeats of (start, end): one of them 4 ms slower
    samples = iter([0.0, 1.0, 0.0, 1.0, 0.0, 5.0])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(samples) / 1e3)
    ms, spread = harness.time_stats(lambda: None, device=torch.device("cpu"), reps=3)
    assert ms == 1.0 and spread == 4.0


@pytest.fixture
def bench_host_stubs(monkeypatch):
    """bench_host stubs the launches and the interpreter check for its own process (without
    --sm90-tool on a CPU): restored after the test, or later tests would launch nothing."""
    from fusedattn.ops.core import backends, triton_launch

    monkeypatch.setattr(triton_launch, "launch", triton_launch.launch)
    monkeypatch.setattr(backends, "triton_interpreter_enabled", backends.triton_interpreter_enabled)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_host_benchmark_runs_and_fills_host_us(tmp_path, monkeypatch, bench_host_stubs):
    import argparse

    import bench_host

    monkeypatch.setattr(bench_host, "host_us", lambda fn, **kw: (fn(), (123.0, 0.5))[1])
    rows = bench_host.run(argparse.Namespace(sm90_tool=None, label=" (test)"))
    triton = [r for r in rows if r["impl"] == "fusedattn-triton (test)"]
    assert {(r["op"], r["mode"], r["causal"]) for r in triton} == {
        ("attention", mode, causal)
        for mode in ("fwd", "bwd", "fwd+bwd")
        for causal in (False, True)
    }
    # the torch backend's key padding (views, or the copy of a mask with a hole) beside the
    # direct SDPA call a user writes
    others = {(r["impl"], r["mask"], r["mode"]) for r in rows if r not in triton}
    assert others == {
        (impl, f"key_padding:{pattern}", mode)
        for impl in ("fusedattn-torch (test)", "sdpa (test)")
        for pattern in ("right", "hole")
        for mode in ("fwd", "bwd", "fwd+bwd")
    }
    timed = [r for r in rows if "not a median" not in r["note"]]
    assert all(r["host_us"] == 123.0 and "NOISY" in r["note"] for r in timed)
    # Flex's halves (issue #84): a cached score_mod and a block mask timed as the rest, and a
    # new mod's first forward+backward once (its real seconds)
    masks = {r["mask"] for r in triton}
    assert {"score_mod:relative_bias", "block_mask:causal16"} <= masks
    (first,) = [r for r in rows if "not a median" in r["note"]]
    assert first["mask"] == "score_mod:learnable_bias" and float(first["host_us"]) > 0


def _rows(**changes):
    env = {"device": "cpu"}
    base = dict(op="softmax", mode="fwd", impl="torch", dtype="float32", M=8, N=16, ms=1.0)
    return [harness.make_row(env, **{**base, "pass": "yes"} | changes)]


def test_compare_flags_slowdowns_beyond_the_tolerance_and_new_failures():
    import report

    old = _rows(ms=1.0)
    assert report.compare(_rows(ms=1.04), old) == []  # within 5%: noise
    slower = report.compare(_rows(ms=1.5), old)
    assert [r.what for r in slower] == ["slower"] and "1.50x" in str(slower[0])
    assert report.compare(_rows(ms=1.5), old, tolerance=0.6) == []
    broken = report.compare(_rows(**{"pass": "no: worst element"}), old)
    assert [r.what for r in broken] == ["incorrect"]
    assert report.compare(_rows(N=32, ms=9.0), old) == []  # a case only one run has


def test_run_all_gate_exits_2_on_a_regression_and_plots(tmp_path, capsys):
    import report
    import run_all

    assert run_all.main(["--device", "cpu", "--only", "softmax", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "softmax.png").stat().st_size > 0
    rows = report.load(tmp_path)
    # The same run against itself is no regression; against a run 10x faster it is.
    assert report.compare(rows, rows) == []
    fast = [dict(r, ms=str(float(r["ms"]) / 10)) for r in rows]
    harness.write_csv(fast, tmp_path / "old" / "softmax.csv")
    code = run_all.main(["--device", "cpu", "--only", "softmax", "--out", str(tmp_path / "new"),
                         "--compare", str(tmp_path / "old"), "--no-plots"])  # fmt: skip
    assert code == 2
    assert "regressions against" in capsys.readouterr().out
    assert report.main([str(tmp_path / "new"), "--compare", str(tmp_path / "old")]) == 2


@pytest.mark.slow
def test_model_benchmark_rows_on_cpu(tmp_path):
    """The whole structure on tiny models (issue #70): the reference transformer's naive,
    plain-SDPA, fusedattn-torch and auto rows; Hugging Face GPT-2, padded BERT and a GQA Llama
    with transformers' sdpa and eager against fusedattn's hook; every mode, compiled ones with
    dynamo's eager backend; each row checked against float64. The compiled modes here for one
    model of each family (GPT-2 small and the HF Llama: dynamo's tracing is 90 % of the full
    run's 100 s on 2 cores; `bench_model.py --quick` compiles every one)."""
    import bench_model

    cpu, env = torch.device("cpu"), harness.environment()
    eager = tuple(m for m in bench_model.MODES if not m.endswith("-compiled"))
    compiled = tuple(m for m in bench_model.MODES if m.endswith("-compiled"))
    rows = bench_model.run(True, cpu, env, modes=eager)
    rows += bench_model.run(True, cpu, env, modes=compiled, models=("gpt2-small", "llama3"))
    ops = {r["op"] for r in rows}
    assert ops == {"model:gpt2-small", "model:bert-base-padded", "hf:gpt2", "hf:bert-padded",
                   "hf:llama3"}  # fmt: skip
    impls = {op: {r["impl"] for r in rows if r["op"] == op} for op in ops}
    assert impls["model:gpt2-small"] == {"naive", "sdpa", "fusedattn-torch", "auto"}
    assert impls["hf:llama3"] == {"sdpa", "eager", "fusedattn"}
    for op in ops:
        modes = {(r["impl"], r["mode"]) for r in rows if r["op"] == op}
        want = set(bench_model.MODES) if op in ("model:gpt2-small", "hf:llama3") else set(eager)
        for impl in impls[op] - {"naive"}:
            assert {m for i, m in modes if i == impl} == want, (op, impl)
    assert all(r["pass"] == "yes" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert all(r["transformers"] for r in rows)
    assert any(r["speedup_vs_naive"] not in ("", 1.0) for r in rows)


@pytest.mark.slow
def test_model_benchmark_times_each_group_in_a_process_of_its_own():
    """--isolate row (a GPU's default): the eager modes of a (model, impl) in one child
    process, each compiled mode in another, nothing compiled in this one; rows come back."""
    import bench_model

    torch._dynamo.utils.counters.clear()
    rows = bench_model.run(True, torch.device("cpu"), {"device": "cpu"}, isolate="row",
                           models=("llama3",), impls=("fusedattn",),
                           modes=("infer", "infer-compiled"))  # fmt: skip
    assert [(r["op"], r["impl"], r["mode"]) for r in rows] == [
        ("hf:llama3", "fusedattn", "infer"),
        ("hf:llama3", "fusedattn", "infer-compiled"),
    ]
    assert all(r["pass"] == "yes" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
@ON_GPU_THE_BENCH_RUNS
def test_model_benchmark_kernel_rows_run_through_the_interpreter(monkeypatch):
    """The GPU-only fusedattn-triton model rows, run here so a GPU session does not find
    their bugs (one layer, one short length, timing stubbed)."""
    import bench_model
    import model_cases

    monkeypatch.setattr(harness, "kernel_backends", lambda op, device: ["triton"])
    monkeypatch.setattr(harness, "time_stats", lambda fn, device, reps=1: (fn(), (1.0, 0.0))[1])
    monkeypatch.setattr(bench_model, "_steady", lambda fn, device, limit=1: None)
    cases = model_cases.cases

    def small(quick, device):
        out = []
        for c in cases(quick, device):
            config = dict(c.config)
            for key in ("n_encoder_layers", "n_decoder_layers", "layers"):
                if config.get(key):
                    config[key] = 1
            out.append(dataclasses.replace(c, lengths=(16,), tokens=32, config=config))
        return out

    monkeypatch.setattr(model_cases, "cases", small)
    rows = bench_model.run(True, torch.device("cpu"), {"device": "cpu"}, impls=("fusedattn-triton",),
                           modes=("infer", "train"))  # fmt: skip
    assert {r["op"] for r in rows} == {"model:gpt2-small", "model:bert-base-padded", "hf:gpt2",
                                       "hf:bert-padded", "hf:llama3"}  # fmt: skip
    assert len(rows) == 10 and all(r["pass"] == "yes" for r in rows)


@pytest.mark.slow
def test_training_demo_rows_and_plot(tmp_path):
    import bench_demo

    rows = bench_demo.train_pair(torch.device("cpu"), harness.environment(), steps=30)
    impls = {r["impl"] for r in rows}
    assert "naive" in impls and len(impls) == 2
    curves = {i: [float(r["loss"]) for r in rows if r["impl"] == i and r["mode"] == "train"]
              for i in impls}  # fmt: skip
    # same weights, same batches: the fused curve tracks the naive one
    naive, fused = curves["naive"], curves[next(i for i in impls if i != "naive")]
    assert len(naive) == len(fused) == 30 and naive[-1] < naive[0]
    assert max(abs(a - b) for a, b in zip(naive, fused, strict=True)) < 1e-3
    assert {r["mode"] for r in rows} == {"train", "greedy", "beam"}
    assert bench_demo.plot(rows, tmp_path / "demo.png").stat().st_size > 0


def test_noisy_rows_are_flagged_where_printed_and_left_out_of_the_summary(capsys):
    env = dict(device="cpu")
    quiet = harness.make_row(env, op="softmax", mode="fwd", impl="torch", ms=1.0, gbps=10.0,
                             spread=0.02)  # fmt: skip
    loud = harness.make_row(env, op="softmax", mode="fwd", impl="torch", ms=9.0, gbps=900.0,
                            spread=0.6, note=harness.noisy(0.6).lstrip("; "))  # fmt: skip
    harness.progress(loud)
    assert "NOISY" in capsys.readouterr().out
    lines = report.summarize([quiet, loud])
    assert lines[0].startswith("  1 of 2 rows NOISY")
    assert "best    10.000 GB/s" in lines[1] and "1 cases" in lines[1]


def test_plot_panels_are_keyed_on_the_op(tmp_path):
    """model.csv holds a decoder and a padded-encoder op: one panel each, not one for both."""
    pytest.importorskip("matplotlib")
    env = dict(device="cpu")
    rows = [
        harness.make_row(
            env,
            op=op,
            mode="train",
            impl=impl,
            dtype="float32",
            Tq=T,
            ms=1.0,
            tokens_per_s=float(T * (2 if impl == "fused" else 1)),
        )
        for op in ("model:tiny-decoder", "model:tiny-encoder-padded")
        for impl in ("naive", "fused")
        for T in (64, 128)
    ]
    assert report.plot(rows, tmp_path / "model.png").exists()


def test_rows_reach_the_csv_as_they_are_measured_so_a_stopped_run_keeps_them(tmp_path, monkeypatch):
    """gpu_check.sh runs each family under `timeout`: a family stopped after its first rows
    leaves those rows in its CSV (with their speedups), never a truncated file."""
    import run_all

    env = harness.environment()

    def stopped_family(quick, device, env=env):
        for impl, ms in (("naive", 4.0), ("fusedattn-triton", 1.0)):
            harness.progress(harness.make_row(env, op="softmax", mode="fwd", impl=impl, ms=ms,
                                              M=8, N=16, **{"pass": "yes"}))  # fmt: skip
        raise KeyboardInterrupt  # what the time limit's signal does to the run

    monkeypatch.setitem(run_all.FAMILIES, "softmax", (stopped_family, "softmax.csv"))
    with pytest.raises(KeyboardInterrupt):
        run_all.main(["--device", "cpu", "--only", "softmax", "--out", str(tmp_path)])
    harness.stream_to(None)
    rows = harness.read_csv(tmp_path / "softmax.csv")
    assert [(r["impl"], r["speedup_vs_naive"]) for r in rows] == [
        ("naive", "1.0"),
        ("fusedattn-triton", "4.0"),
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["softmax.csv"]  # no temporary file left


@pytest.mark.slow
@ON_GPU_THE_BENCH_RUNS
def test_attention_warm_up_runs_each_cases_triton_calls_once(monkeypatch):
    """What run_all's parallel warm-up runs per case (through the interpreter here): the
    Triton impls that case times, check included, and nothing else; no failures."""
    import bench_attention

    monkeypatch.setattr(harness, "kernel_backends", lambda op, device: ["triton"])
    calls = []
    run_once = harness.run_once
    monkeypatch.setattr(harness, "run_once",
                        lambda impls, leaves, check: calls.append(sorted(impls))
                        or run_once(impls, leaves, check))  # fmt: skip
    cpu = torch.device("cpu")
    grid = [interpreter_sized(c) for c in bench_attention.cases(True, cpu)]
    monkeypatch.setattr(bench_attention, "cases", lambda quick, device: grid)
    for mask in ("key_padding", "window", "varlen"):
        calls.clear()
        index = next(i for i, c in enumerate(grid) if c.mask == mask)
        assert bench_attention.warm(index, True, cpu) == []
        ran = sorted(name for names in calls for name in names)
        expected = {"key_padding": ["fusedattn-triton"], "varlen": ["fusedattn-triton"],
                    "window": ["fusedattn-triton", "fusedattn-triton+dense"]}[mask]  # fmt: skip
        assert ran == expected


def test_parallel_warm_up_runs_every_case_in_child_processes_and_never_fails_the_run(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "fake_family.py").write_text(
        "from pathlib import Path\n"
        "def warm(index, quick, device):\n"
        "    if index == 1:\n"
        "        raise RuntimeError('child boom')\n"
        f"    Path({str(tmp_path)!r}, f'warmed{{index}}-{{quick}}-{{device}}').touch()\n"
        "    return ['case 2: fusedattn-triton: refused'] if index == 2 else []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned children get this sys.path
    harness.warm_in_parallel("fake_family", 3, True, torch.device("cpu"), jobs=2)
    assert sorted(p.name for p in tmp_path.glob("warmed*")) == [
        "warmed0-True-cpu",
        "warmed2-True-cpu",
    ]
    text = capsys.readouterr().out
    assert "child boom" in text and "case 2: fusedattn-triton: refused" in text
    assert "compiled 3 cases' kernels" in text


ROOT = Path(__file__).resolve().parent.parent


def test_profile_model_prints_autos_choices_and_the_step_time(capsys):
    """scripts/profile_model.py (the models preset's profile: where auto trails the best
    baseline a user has) on the CPU's tiny model: each impl's step time against the fastest,
    every auto call's key and the backend it ran, a profiler table."""
    spec = importlib.util.spec_from_file_location(
        "profile_model", ROOT / "scripts" / "profile_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--model", "gpt2-small", "--impls", "sdpa,auto", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "== sdpa:" in out and "== auto:" in out and "ms per infer step" in out
    assert "the fastest)" in out
    assert (
        "auto:   1 x attention ('fwd', 'float32', 64, True, 'key_padding', '<=256') -> torch" in out
    )
    assert "x layer_norm ('fwd', 'float32', '<=1k') -> torch" in out


def test_tune_decode_times_each_split_count_and_checks_it_against_the_chosen_one():
    """scripts/tune_decode.py (a gpu_check step: the decode kernel's key splits, the paged-16
    cache at batch 8 was 1.68x contiguous on the H200) on a tiny paged case in the interpreter:
    the chosen split count and its neighbours, each output within fp32 merging of the chosen."""
    spec = importlib.util.spec_from_file_location(
        "tune_decode", ROOT / "scripts" / "tune_decode.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.tune_case(2, 64, "paged16", torch.device("cpu"), torch.float32, 4, 2, 16, None)
    splits = [r["num_splits"] for r in rows]
    assert splits == sorted(set(splits)) and len(splits) >= 2
    assert sum(r["chosen"] for r in rows) == 1
    assert all(r["max_abs_diff"] < 1e-5 and r["ms"] > 0 for r in rows)


def test_static_decode_screen_lays_out_the_kernels_parameters(monkeypatch):
    """scripts/static_decode.py builds attention_decode's arguments by hand: each case binds to
    the kernel's signature (it once missed a parameter added later and screened nothing)."""
    import inspect

    from fusedattn.triton_kernels import decode as K

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its sibling screens, as when run

    spec = importlib.util.spec_from_file_location(
        "static_decode", ROOT / "scripts" / "static_decode.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = inspect.signature(K.attention_decode.fn)
    for name in module.CASES:
        args, constexprs, _ = module.launch_args(name)
        kernel_args = {k: v for k, v in constexprs.items() if k not in ("num_warps", "num_stages")}
        bound = signature.bind(*args, **kernel_args)  # TypeError on a missing or extra one
        assert set(bound.arguments) == set(signature.parameters), name


def test_host_benchmark_times_decoding_as_inference_only(monkeypatch, bench_host_stubs):
    """Decoding has no backward: its rows are fwd alone, with the cache layout in `mask`."""
    import argparse

    import bench_host

    monkeypatch.setattr(bench_host, "host_us", lambda fn, **kw: (fn(), (50.0, 0.01))[1])
    monkeypatch.setattr(bench_host, "DECODE", (1, 4, 2, 16, 40))  # interpreter-sized
    every = bench_host.cases

    def decode_only(fusedattn, device, dtype, every_op):
        return [c for c in every(fusedattn, device, dtype, True) if c[0] == "decode"]

    monkeypatch.setattr(bench_host, "cases", decode_only)
    rows = bench_host.run(argparse.Namespace(sm90_tool=None, label="", first_call=False))
    assert [(r["op"], r["mode"], r["mask"], r["Tk"]) for r in rows] == [
        ("decode", "fwd", "contiguous", 40),
        ("decode", "fwd", "contiguous+append", 40),
        ("decode", "fwd", "hf", 40),  # the Hugging Face decode step, without a mask
        ("decode", "fwd", "hf+padding", 40),  # and with a padding mask
    ]
    assert all(r["host_us"] == 50.0 and "NOISY" not in r["note"] for r in rows)


def test_plots_keep_each_impls_colour_across_panels_and_name_every_impl(tmp_path, monkeypatch):
    """An impl absent from the first panel (sdpa-flash refuses key padding) is still in the
    legend, and every impl has one colour in every panel (the colours shifted between the
    H200 attention plot's panels)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    env = dict(device="cpu")
    rows = [
        harness.make_row(
            env,
            op="attention",
            mode="fwd+bwd",
            impl=impl,
            dtype="bfloat16",
            D=128,
            mask=mask,
            Tq=T,
            Tk=T,
            ms=1.0,
            tflops=float(T),
        )
        for mask, impls in (
            ("key_padding", ("naive", "triton")),
            ("none", ("flash", "naive", "triton")),
        )
        for impl in impls
        for T in (1024, 2048)
    ]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert report.plot(rows, tmp_path / "attention.png").exists()
    (fig,) = figures
    colours = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            assert colours.setdefault(line.get_label(), line.get_color()) == line.get_color()
    assert set(colours) == {"flash", "naive", "triton"}
    (legend,) = fig.legends
    assert sorted(t.get_text() for t in legend.get_texts()) == ["flash", "naive", "triton"]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tune_triton_attention_checks_each_candidate_against_float64_before_timing(tmp_path):
    """scripts/tune_triton_attention.py (gpu_check's hopper preset, issue #61) in its CPU dry
    run: every forward and dK/dV candidate (warp-specialized, pipelined, persistent and the
    rotated backward included) passes the k× check against float64 on its slice and gets a
    time; the CSV carries the card (arch 0 here) and build_tile_table keeps no CPU row."""
    tune = _script("tune_triton_attention")
    assert tune.main(["--out", str(tmp_path), "--cases", "d64c", "--kernels", "fwd,dkdv",
                      "--baselines"]) == 0  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "tune_triton_attention.csv").open()))
    for kernel in ("fwd", "dkdv"):
        mine = [r for r in rows if r["kernel"] == kernel]
        assert {r["tiles"] for r in mine} == {"shipped", *tune.CANDIDATES[kernel]}
        assert all(r["pass"] == "yes" and float(r["ms"]) > 0 and r["arch"] == "0" for r in mine)
    table, _ = _script("build_tile_table").choose(rows, 0.02)
    assert table == {}


def test_build_tile_table_takes_a_candidate_only_where_it_passed_and_won_everywhere(tmp_path):
    """Per card, head-dim block and kernel: the best geometric-mean speedup over the plain and
    causal cases at every length, among candidates that passed the float64 check at every one
    of those points, if it beats the shipped tiles by the margin; the table it writes is what
    attention_config reads."""
    build = _script("build_tile_table")

    def row(case, T, kernel, tiles, speedup, ok="yes"):
        return dict(arch="90", case=case, T=str(T), kernel=kernel, tiles=tiles,
                    speedup=str(speedup), **{"pass": ok})  # fmt: skip

    rows = [row(c, t, "fwd", "shipped", 1.0) for c in ("d128", "d128c") for t in (1024, 4096)]
    rows += [row(c, t, "fwd", "128x128w4s2w", 1.2) for c in ("d128", "d128c") for t in (1024, 4096)]
    rows += [
        row(c, t, "fwd", "128x64w8s3p", 1.5) for c in ("d128",) for t in (1024, 4096)
    ]  # causal missing
    rows += [row(c, t, "dq", "128x64w8s3", 1.01) for c in ("d128", "d128c") for t in (1024, 4096)]
    rows += [row(c, t, "dkdv", "64x64w8s3", 1.3, "no: worse") for c in ("d128", "d128c")
             for t in (1024, 4096)]  # fmt: skip
    rows += [row("d128cs", 4096, "fwd", "64x64w4s2", 9.0)]  # softcap: not a choosing case
    table, notes = build.choose(rows, 0.02)
    assert table == {90: {128: {"fwd": "128x128w4s2w"}}}
    assert any("dq: shipped kept" in n for n in notes)
    assert any("dkdv: no candidate passed everywhere" in n for n in notes)
    out = tmp_path / "attention_tiles.py"
    out.write_text(build.render(table, ["t.csv"], notes))
    namespace = {}
    exec(out.read_text(), namespace)
    assert namespace["TABLE"] == table and "128x128w4s2w" in namespace["SOURCE"]


def test_attention_config_takes_the_tuned_tiles_of_its_card(monkeypatch):
    from fusedattn.triton_kernels import attention as A
    from fusedattn.triton_kernels import attention_tiles

    monkeypatch.setattr(attention_tiles, "TABLE",
                        {90: {128: {"fwd": "128x128w4s2w", "dkdv": "64x128w8s2m"}}})  # fmt: skip
    A.attention_config.cache_clear()
    try:
        cfg = A.attention_config(128, 128, True, arch=90)
        assert cfg.fwd.spec == "128x128w4s2w" and cfg.dkdv.spec == "64x128w8s2m"
        assert cfg.dq == A.attention_config(128, 128, True, arch=80).dq  # not in the table
        assert A.attention_config(128, 128, True, arch=90, alibi_or_varlen=True).dkdv.merge is False
        assert A.attention_config(64, 64, True, arch=90).fwd.spec == "128x64w8s3"  # other block
        assert A.attention_config(128, 128, True, arch=90, elem_bytes=1).fwd.spec == "128x64w8s3"
    finally:
        monkeypatch.undo()
        A.attention_config.cache_clear()


@pytest.mark.slow
def test_context_parallel_benchmark_times_each_strategy_on_gloo_and_ulysses_calls(monkeypatch):
    """bench_context_parallel.py on the CPU: each strategy's whole call on 2 gloo ranks; its
    GPU Ulysses rows (one rank's call at W = 2, 4, 8 and the all-to-all bytes) through the
    interpreter on a small sequence, timing stubbed."""
    import bench_context_parallel as bcp

    rows = bcp.run(True, torch.device("cpu"), {"device": "cpu"})
    assert [r["impl"] for r in rows] == ["ring W=2", "allgather W=2", "ulysses W=2"]
    assert all(float(r["ms"]) > 0 for r in rows)
    monkeypatch.setattr(harness, "time_ms", lambda fn, device, reps=1: (fn(), 1.0)[1])
    q = torch.randn(1, 8, 16, 16)
    k, v = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    out = bcp.run_ulysses(True, torch.device("cpu"), {"device": "cpu"}, q, k, v,
                          {"fwd": 1.0, "fwd+bwd": 1.0})  # fmt: skip
    assert [r["impl"] for r in out] == [f"fusedattn-triton W={w}" for w in (2, 4, 8)
                                        for _ in range(2)]  # fmt: skip
    # W = 2: q, k, v and out of 8 positions, half of them sent: 8·(2·8·16 + 2·2·16)·2 B / 2
    assert bcp.ulysses_bytes(16, 2, 8, 2, 16) == 0.5 * 8 * (2 * 8 * 16 + 2 * 2 * 16) * 2
    assert "all-to-all bytes per rank" in out[0]["note"]


def test_flex_benchmark_runs_each_pattern_and_builds_the_document_mask_on_the_cpu():
    """bench_flex.py on the CPU: each pattern's block-mask call (the dense path there) and the
    document mask's build with its time and peak memory (at 8k here; the script's own CPU
    run builds 128k, the GPU preset times the kernels against Flex)."""
    import bench_flex

    env = {"device": "cpu"}
    rows = bench_flex.run(True, torch.device("cpu"), env)
    assert [r["mask"] for r in rows] == ["document causal, 4 docs", "document causal, 16 docs",
                                         "prefix-LM, prefix T/4", "causal", "softcap 30",
                                         "alibi", "relative bias", "learnable relative bias"]  # fmt: skip
    assert all(float(r["ms"]) > 0 for r in rows)
    built = bench_flex.build_rows(env, torch.device("cpu"), T=8192)
    assert [r["impl"] for r in built] == ["fusedattn"] and "peak extra memory" in built[0]["note"]


def test_invariant_benchmark_times_decoding_with_the_switch_off_and_on_and_checks_the_bits():
    """bench_invariant.py on the CPU: each shape off and on (through the interpreter, a tiny
    cache), the "on" rows saying whether sequence 0's bits alone equal its bits in the batch;
    then the projections' matmul, torch's and the invariant one, with the same check."""
    import bench_invariant

    from fusedattn import invariance

    rows = bench_invariant.run(True, torch.device("cpu"), {"device": "cpu"})
    decode, matmul = rows[:4], rows[4:]
    assert [r["impl"] for r in decode] == ["fusedattn-triton off", "fusedattn-triton on"] * 2
    assert all("alone == in the batch: True" in r["note"] for r in decode[1::2])
    # the projections: torch's F.linear and the invariant matmul at M = 1 and 8
    assert [(r["impl"], r["M"]) for r in matmul] == [
        ("torch F.linear", 1), ("fusedattn-triton on", 1),
        ("torch F.linear", 8), ("fusedattn-triton on", 8),
    ]  # fmt: skip
    assert all("alone == among the" in r["note"] and ": True" in r["note"] for r in matmul[1::2])
    assert not invariance.enabled()  # the switch restored


def test_mla_benchmark_runs_each_path_on_the_cpu():
    """bench_mla.py on the CPU: one tiny latent-cache call per path (the GPU preset `mla`
    times the Triton kernel against the copy rate and vLLM's TRITON_MLA)."""
    import bench_mla

    rows = bench_mla.run(True, torch.device("cpu"), {"device": "cpu"})
    assert [r["impl"] for r in rows] == ["fusedattn-torch", "fusedattn-reference"]
    assert all(r["op"] == "mla-decode" and float(r["ms"]) > 0 for r in rows)
    assert bench_mla.FLOP_PER_KEY == 2176  # 2 x (576 + 512): the arithmetic


def test_static_mla_screen_lays_out_the_kernels_parameters(monkeypatch):
    """scripts/static_mla.py builds mla_decode's arguments by hand: each case binds to the
    kernel's signature, with the shipped tiles and with candidates."""
    import inspect

    from fusedattn.triton_kernels import mla as K

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("static_mla", ROOT / "scripts" / "static_mla.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = inspect.signature(K.mla_decode.fn)
    for name in module.CASES:
        for tiles in (None, module.parse_tiles("32x64w8s3")):
            args, constexprs, _ = module.launch_args(name, tiles)
            kernel_args = {k: v for k, v in constexprs.items()
                           if k not in ("num_warps", "num_stages")}  # fmt: skip
            bound = signature.bind(*args, **kernel_args)
            assert set(bound.arguments) == set(signature.parameters), name


def test_host_instructions_reads_the_last_dumps_as_its_cases(tmp_path, monkeypatch):
    """host_instructions.py runs itself under callgrind (not here: no valgrind run in the
    suite) and reads one dump per case, the last ones (torch calls functools.reduce at
    import too): faked dumps, the counts per call and the ratios to the plain call."""
    import argparse
    import subprocess

    import host_instructions

    names = ["fwd plain", "fwd block_mask:causal16", "fwd+bwd plain", "fwd+bwd block_mask:causal16"]

    real_run = subprocess.run

    def fake_valgrind(cmd, **kwargs):
        if cmd[0] != "valgrind":  # git, for the environment's columns
            return real_run(cmd, **kwargs)
        out = Path(next(a for a in cmd if a.startswith("--callgrind-out-file=")).split("=")[1])
        for i, total in enumerate((5, 7, 1000, 1300, 4000, 5200), start=1):  # 2 at import
            out.with_name(f"{out.name}.{i}").write_text(f"events: Ir\nsummary: {total * 100}\n")
        return subprocess.CompletedProcess(cmd, 0, "CASES\t" + "\t".join(names) + "\n", "")

    monkeypatch.setattr(host_instructions.shutil, "which", lambda name: "/usr/bin/valgrind")
    monkeypatch.setattr(host_instructions.subprocess, "run", fake_valgrind)
    args = argparse.Namespace(sm90_tool="tool.py", calls=100, label="@x", out=tmp_path)
    assert host_instructions.parent(args) == 0
    rows = harness.read_csv(tmp_path / "host_instructions.csv")
    got = {(r["mode"], r["mask"]): r["note"].split(",")[0] for r in rows}
    assert got == {
        ("fwd", ""): "1000 instructions per call (callgrind)",
        ("fwd", "block_mask:causal16"): "1300 instructions per call (callgrind)",
        ("fwd+bwd", ""): "4000 instructions per call (callgrind)",
        ("fwd+bwd", "block_mask:causal16"): "5200 instructions per call (callgrind)",
    }
    assert "1.300x the plain call" in rows[1]["note"] and rows[1]["impl"] == "fusedattn-triton@x"
