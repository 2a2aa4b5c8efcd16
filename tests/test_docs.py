"""The README and docs/ as a user reads them (issue #33): every python block runs as written
(a fresh interpreter, CPU), every command names a script, module or make target that exists
and answers --help, every relative link points at a file, and the generated blocks (results,
support matrix) are current."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def blocks(language):
    for page in PAGES:
        for m in BLOCK.finditer(page.read_text(encoding="utf-8")):
            if m.group(1) == language:
                yield page.relative_to(ROOT), m.group(2)


PYTHON = list(blocks("python"))
COMMANDS = [(page, line.split("#")[0].strip()) for page, text in blocks("bash")
            for line in text.splitlines() if line.split("#")[0].strip()]  # fmt: skip


def env():
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def test_the_readme_stays_under_300_lines():
    """Issue #82: its first screen lets a user decide; the details live in docs/ (the refusals
    in docs/backends.md)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines"
    assert "Refusals, as the code words them" in (ROOT / "docs" / "backends.md").read_text()


def test_the_docs_pages_exist_and_the_readme_links_them():
    names = {"api", "backends", "modules", "install", "benchmarks", "performance", "development",
             "vllm"}  # fmt: skip
    assert {p.stem for p in (ROOT / "docs").glob("*.md")} >= names
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in names:
        assert f"(docs/{name}.md)" in readme


# A page's python blocks, each run in order with a namespace of its own (a block that forgot an
# import fails), in one interpreter per page: one torch import instead of one a block (19
# blocks, 65 of CI's worker seconds, 2026-12-02). The runner resets fusedattn's global switch
# between blocks, so no block leans on the one before it.
BLOCK_RUNNER = """
import json, sys, traceback
for number, code in enumerate(json.loads(sys.argv[1])):
    try:
        exec(compile(code, f"block {number}", "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"BLOCK {number} FAILED", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    if "fusedattn" in sys.modules:
        sys.modules["fusedattn"].batch_invariant(False)
"""
PAGES_WITH_PYTHON = sorted({str(page) for page, _ in PYTHON})


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_PYTHON)
def test_python_blocks_run_as_written(page):
    codes = [code for p, code in PYTHON if str(p) == page]
    if any("transformers" in code for code in codes):
        pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, "-c", BLOCK_RUNNER, json.dumps(codes)], cwd=ROOT,
                            env=env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    failed = re.search(r"BLOCK (\d+) FAILED", result.stderr)
    code = codes[int(failed.group(1))] if failed else ""
    assert result.returncode == 0, f"{page}:\n{code}\n{result.stderr[-3000:]}"


def test_a_failing_block_is_named_and_fails_the_run():
    """The runner itself: a block without its import fails although the block before had it."""
    codes = ["import math\nprint(math.pi)", "print(math.pi)"]
    result = subprocess.run([sys.executable, "-c", BLOCK_RUNNER, json.dumps(codes)], cwd=ROOT,
                            env=env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 1 and "BLOCK 1 FAILED" in result.stderr


# Every documented python command's --help, answered in one interpreter (runpy, argv and
# sys.path as `python ...` sets them): 12 distinct targets, one torch import instead of 16.
HELP_RUNNER = """
import contextlib, io, json, os, runpy, sys, traceback
answers = {}
for target in json.loads(sys.argv[1]):
    argv, path, out, code = sys.argv[:], sys.path[:], io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if target[0] == "-m":
                sys.argv = [target[1], "--help"]
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target[0], "--help"]
                sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
                runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        code = 1
        out.write(traceback.format_exc())
    finally:
        sys.argv, sys.path = argv, path
    answers[" ".join(target)] = [code, out.getvalue()[-2000:]]
print("HELP ANSWERS " + json.dumps(answers))
"""


def command_words(command):
    words = command.split()
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # an environment assignment first
        words = words[1:]
    return words


def python_target(words):
    return words[1:3] if words[1] == "-m" else words[1:2]


@pytest.fixture(scope="module")
def help_answers():
    """{target: [exit code, output]} of `python TARGET --help` for every documented target."""
    targets = sorted({tuple(python_target(w)) for w in map(command_words, (c for _, c in COMMANDS))
                      if w[0] == "python"})  # fmt: skip
    result = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(targets)], cwd=ROOT,
                            env=env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    line = [x for x in result.stdout.splitlines() if x.startswith("HELP ANSWERS ")]
    assert line, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(line[-1][len("HELP ANSWERS ") :])


@pytest.mark.parametrize("page,command", COMMANDS, ids=[c for _, c in COMMANDS])
def test_commands_name_what_exists(page, command, help_answers):
    """make targets exist in the Makefile; python scripts and modules exist and answer --help
    (running the real thing is what CI's make test and the GPU runs do)."""
    words = command_words(command)
    if words[0] == "make":
        makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
        assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), command
        return
    if words[0] == "pip":
        assert words[1] == "install", command
        return
    assert words[0] == "python", command
    if words[1] != "-m":
        assert (ROOT / words[1]).exists(), command
    code, output = help_answers[" ".join(python_target(words))]
    assert code == 0, f"{command}: {output}"


def test_relative_links_point_at_files():
    for page in PAGES:
        prose = BLOCK.sub("", page.read_text(encoding="utf-8"))
        prose = re.sub(r"`[^`]*`", "", prose)  # code spans: kernel[grid](...) is no link
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", prose):
            assert (page.parent / link).exists(), f"{page.relative_to(ROOT)} links {link}"


def test_the_readme_results_block_is_generated_from_the_committed_csvs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import headline

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split(headline.START, 1)[1].split(headline.END, 1)[0]
    assert block.strip() == headline.markdown().strip(), (
        "README.md's results are stale: run python benchmarks/headline.py --update README.md"
    )


def test_the_results_block_shows_decode_and_model_runs_once_a_gpu_has_measured_them(
    tmp_path, monkeypatch
):
    """Synthetic H200 decode and model CSVs: their rows reach the README block (no family a
    GPU run measured is dropped), SDPA's column is its fastest backend, OOM is said."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import harness
    import headline

    env = {"device": "NVIDIA H200", "date": "2026-12-01T10:00:00"}
    decode = dict(op="decode", mode="fwd", dtype="bfloat16", H=32, Tq=1, D=128, causal=False,
                  B=1, Tk=32768, mask="contiguous", **{"pass": "yes"})  # fmt: skip
    timed = {"fusedattn-triton": (0.0125, 85.2), "sdpa-flash": (0.05, 21.0),
             "sdpa-cudnn": (0.04, 26.5), "fusedattn-torch": (0.2, 5.0),
             "fusedattn-triton-graph": (0.01, 95.4), "sdpa-flash-graph": (0.045, 23.6),
             "sdpa-cudnn-graph": (0.03, 35.4)}  # fmt: skip
    rows = [harness.make_row(env, **decode, impl=impl, ms=ms, pct_of_copy=pct)
            for impl, (ms, pct) in timed.items()]  # fmt: skip
    rows.append(harness.make_row(env, op="generate", mode="infer", impl="fusedattn", B=8, Tq=128,
                                 Tk=2176, ms=500.0, tokens_per_s=2048.0))  # fmt: skip
    model = dict(op="model:bert-base-padded", dtype="bfloat16", B=8, H=12, Tq=2048, Tk=2048, D=768)
    models = [harness.make_row(env, **model, mode="train", impl="auto", ms=100.0,
                               tokens_per_s=163840.0),
              harness.make_row(env, **model, mode="train", impl="naive", note="out of memory")]  # fmt: skip
    harness.write_csv(rows, tmp_path / "h200" / "decode.csv")
    harness.write_csv(models, tmp_path / "h200" / "model.csv")
    monkeypatch.setattr(headline, "RESULTS", tmp_path)
    text = headline.markdown()
    # eager and CUDA-graph columns kept apart; flashinfer and Flex, never measured, left out
    assert ("| batch, cache, layout | fusedattn-triton | fusedattn-torch | sdpa (best) | "
            "fusedattn-triton-graph | sdpa-graph (best) |") in text  # fmt: skip
    assert (
        "| 1, 32k, contiguous | 85 % (12 µs) | 5 % (200 µs) | 26 % (40 µs) | 95 % (10 µs) | 35 % (30 µs) |"
        in text
    )
    assert "**generate**, tokens/s, 2 layers of Llama-3-8B shape, batch 8" in text
    assert "fusedattn 2048" in text
    assert "| bert-base-padded, train, 2048 | OOM | — | 163.8k | — | — |" in text
    assert "benchmarks/results/h200/decode.csv" in text and "Not yet measured" not in text


def test_model_headline_compares_auto_with_the_best_baseline_a_user_has(tmp_path, monkeypatch):
    """With the user baselines measured (issue #70), each model, length and mode shows the
    fastest of transformers' sdpa / eager / flash_attention_2 (plain SDPA for the reference
    transformer) against auto, eager against eager and compiled against compiled, with both
    ratios; fusedattn-torch (fusedattn's own wrapper) is no baseline."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import harness
    import headline

    env = {"device": "NVIDIA H200", "date": "2026-12-01T10:00:00"}
    shape = dict(dtype="bfloat16", B=32, H=12, Tq=512, Tk=512, D=768, **{"pass": "yes"})
    speeds = {("hf:gpt2", "infer", "sdpa"): 1000e3, ("hf:gpt2", "infer", "eager"): 800e3,
              ("hf:gpt2", "infer", "fusedattn"): 1100e3,
              ("hf:gpt2", "infer-compiled", "sdpa"): 1500e3,
              ("hf:gpt2", "infer-compiled", "fusedattn"): 1200e3,
              ("model:gpt2-small", "train", "sdpa"): 300e3,
              ("model:gpt2-small", "train", "fusedattn-torch"): 900e3,
              ("model:gpt2-small", "train", "auto"): 330e3}  # fmt: skip
    rows = [harness.make_row(env, op=op, mode=mode, impl=impl, tokens_per_s=t, **shape)
            for (op, mode, impl), t in speeds.items()]  # fmt: skip
    harness.write_csv(rows, tmp_path / "h200" / "model.csv")
    monkeypatch.setattr(headline, "RESULTS", tmp_path)
    text = headline.markdown()
    assert "auto against the best baseline a user has" in text
    assert (
        "| hf:gpt2, 512, infer | sdpa 1000.0k | 1100.0k | 1.10× | sdpa 1500.0k | 1200.0k | 0.80× |"
        in text
    )
    assert "| model:gpt2-small, 512, train | sdpa 300.0k | 330.0k | 1.10× | — | — | — |" in text
