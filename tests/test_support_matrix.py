"""The README's support matrix is the code's: generated from the backends' refusal rules
(fusedattn.support), and stale if the README block differs (issue #31 item 9, issue #33)."""

import itertools
import pathlib
import re

import torch

import fusedattn
from fusedattn import support
from fusedattn.ops.core import backends

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


BACKENDS_DOC = README.parent / "docs" / "backends.md"


def test_the_readme_block_is_what_the_code_generates():
    text = README.read_text(encoding="utf-8")
    block = text.split(support.START, 1)[1].split(support.END, 1)[0]
    assert block.strip() == support.markdown().strip(), (
        "README.md's support matrix is stale: run python -m fusedattn.support --update README.md"
    )


def test_the_refusals_in_docs_backends_are_what_the_code_generates():
    text = BACKENDS_DOC.read_text(encoding="utf-8")
    block = text.split(support.REFUSALS_START, 1)[1].split(support.REFUSALS_END, 1)[0]
    assert block.strip() == support.refusals_markdown().strip(), (
        "docs/backends.md's refusals are stale: run python -m fusedattn.support --refusals "
        "docs/backends.md"
    )


def test_every_refusal_the_torch_backend_words_is_listed():
    """The refusals the issue found missing (return_lse on torch) come from the code itself."""
    table = support.markdown()
    assert "torch, return_lse: torch's scaled_dot_product_attention does not return" in (
        support.refusals_markdown()
    )
    row = next(line for line in table.splitlines() if line.startswith("| return_lse |"))
    assert row.split("|")[3].strip() == support.NO  # the torch column


def test_a_new_refusal_shows_up_in_the_table(monkeypatch):
    """The table reads the registered refusal functions: a backend that starts refusing a
    feature gets a ✗ and its reason, with nothing else to edit."""
    impl = backends._REGISTRY["attention"]["reference"]

    def refuse_dropout(**inputs):
        return ["no dropout here"] if inputs["dropout_p"] > 0 else []

    monkeypatch.setitem(
        backends._REGISTRY["attention"], "reference",
        backends.Implementation(impl.op, impl.backend, impl.run, refuse_dropout),
    )  # fmt: skip
    table = support.markdown()
    row = next(line for line in table.splitlines() if line.startswith("| dropout |"))
    assert row.split("|")[2].strip() == support.NO
    assert "- reference, dropout: no dropout here" in support.refusals_markdown()


def test_taking_the_inputs_runs_no_backend():
    op, inputs = support.dispatch_inputs(fusedattn.attention, *support._qkv(), return_lse=True)
    assert op == "attention" and inputs["return_lse"] is True
    assert backends.select.__name__ == "select"  # restored


def _shape_of(reason: str) -> str:
    """A refusal's words without the call's particulars (dtypes, sizes)."""
    return re.sub(r"torch\.\w+|\d+", "#", reason)


def test_every_decode_refusal_the_code_makes_has_a_row():
    """A grid over the decode options (dtype, head dim, ALiBi, sinks and their dtype, softcap,
    return_lse, paged) through each backend's refusal rules: every distinct reason is one the
    table lists (it missed torch's half-precision ALiBi and sinks of another dtype, and
    Triton's fp64 and head dims past 256)."""
    listed = set()
    for line in support.refusals_markdown().splitlines():  # "- backend, feature: reason"
        backend, _, rest = line[2:].partition(", ")
        feature, _, reason = rest.partition(": ")
        if line.startswith("- ") and feature.startswith(("decode", "attention_with_kvcache")):
            listed.add((backend, _shape_of(reason)))
    seen = set()
    grid = itertools.product(
        (torch.float16, torch.bfloat16, torch.float32, torch.float64), (64, 320),
        (False, True), (None, "same", "fp32"), (0.0, 5.0), (False, True), (False, True),
    )  # fmt: skip
    for dtype, D, alibi, sinks, softcap, lse, paged in grid:
        sink = {None: None, "same": torch.zeros(4, dtype=dtype), "fp32": torch.zeros(4)}[sinks]
        kw = dict(alibi_slopes=torch.ones(4) if alibi else None, sinks=sink, softcap=softcap,
                  return_lse=lse)  # fmt: skip
        fn, args, kwargs = support._decode(dtype, paged, D, **kw)()
        op, inputs = support.dispatch_inputs(fn, *args, **kwargs)
        for backend in ("reference", "torch", "triton"):
            for reason in backends._REGISTRY[op][backend].refusals(**inputs):
                seen.add((backend, _shape_of(reason)))
    missing = sorted(f"{b}: {r}" for b, r in seen - listed)
    assert not missing, "refusals with no row in the support matrix:\n" + "\n".join(missing)
    assert len(seen) >= 6
