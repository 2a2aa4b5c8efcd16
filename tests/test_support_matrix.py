"""The README's support matrix is the code's: generated from the backends' refusal rules
(fusedattn.support), and stale if the README block differs (issue #31 item 9, issue #33)."""

import pathlib

import fusedattn
from fusedattn import support
from fusedattn.ops import backends

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_block_is_what_the_code_generates():
    text = README.read_text(encoding="utf-8")
    block = text.split(support.START, 1)[1].split(support.END, 1)[0]
    assert block.strip() == support.markdown().strip(), (
        "README.md's support matrix is stale: run python -m fusedattn.support --update README.md"
    )


def test_every_refusal_the_torch_backend_words_is_listed():
    """The refusals the issue found missing (return_lse on torch) come from the code itself."""
    table = support.markdown()
    assert "torch, return_lse: torch's scaled_dot_product_attention does not return" in table
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
    assert "- reference, dropout: no dropout here" in table


def test_taking_the_inputs_runs_no_backend():
    op, inputs = support.dispatch_inputs(fusedattn.attention, *support._qkv(), return_lse=True)
    assert op == "attention" and inputs["return_lse"] is True
    assert backends.select.__name__ == "select"  # restored
