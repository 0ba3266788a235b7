"""Every number a chapter's prose states is computed, cited or a declared definition.

See :mod:`prose_numbers` for what counts as accounted for. The last test shows the
scanner flags a typed claim and passes the same claim glued, in code or in math.
"""

from __future__ import annotations

import os

import pytest

import prose_numbers

NOTEBOOKS = sorted(n for n in os.listdir(os.path.join(prose_numbers.ROOT, "notebooks"))
                   if n.endswith(".ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_no_number_typed_by_hand(notebook):
    found = prose_numbers.claims(os.path.join(prose_numbers.ROOT, "notebooks", notebook))
    assert not found, (
        f"{len(found)} number(s) in the prose of {notebook} are neither glued, cited "
        "nor in tests/prose_numbers/ (glue them from the cell that computes them, "
        "assert them, or allow-list a definition with its reason):\n  "
        + "\n  ".join(map(str, found)))


def test_the_scanner_flags_a_typed_claim_and_passes_accounted_ones():
    def flagged(text, allow=()):
        return [c.phrase for c in prose_numbers.claims_in_text(text, "x", list(allow))]

    assert flagged("A step takes 300 ms on this machine.") == ["300 ms"]
    assert flagged("It sends 4.5 MiB, one quarter of 18.") == ["4.5 MiB", "18"]
    assert flagged("A step takes {glue:text}`ch0_ms:.0f` ms.") == []
    assert flagged("Use `torch.zeros(300)` and $2(N-1)/N$ of 16 GB.") == ["16 GB"]
    assert flagged("In fp32, ZeRO-3 and 1F1B on Llama-2 13B (Chapter 4, rank 0).") == []
    assert flagged("A 16-bit cast of 7.5B parameters on 8 GPUs.") == []
    assert flagged("Smith et al. (2018) measured 3x.") == ["3x"]
    assert flagged("The cell sets 12 samples.", ["12 samples"]) == []


def test_the_scanner_reads_numbers_in_words_math_names_and_directives():
    def flagged(text, allow=()):
        return [c.phrase for c in prose_numbers.claims_in_text(text, "x", list(allow))]

    # numbers in words before a unit, and ratios in words
    assert flagged("Adam's counters take a few hundred bytes.") == ["a few hundred bytes"]
    assert flagged("fp16 is eight times more precise.") == ["eight times"]
    assert flagged("Stage 2 keeps a quarter of the gradients.") == ["a quarter of"]
    # a stale run time, in words; a reading time is not a measurement
    assert flagged("**Time:** about a minute and a half to run.") == [
        "a minute and a half"]
    assert flagged("**Time:** about 30 minutes to read.") == []
    # a value computed inside math; a symbol's definition is a setting
    assert flagged("The sum has $4h = 128$ terms, with $h = 32$.") == ["128"]
    assert flagged(r"so $128 \cdot u \approx 7 \times 10^{-4}$ bounds it.") == [
        r"7 \times 10^{-4}"]
    # a size written as a name is still a claim; a glued one is not
    assert flagged("a 10M-parameter model") == ["10M-parameter"]
    assert flagged("{glue:text}`ch_b:.1f` billion parameters") == []
    # a directive's prose and the text after an option line are scanned; a citation
    # beside a figure accounts for it
    assert flagged("```{note}\nIt takes 300 ms.\n```") == ["300 ms"]
    assert flagged("```{figure} a.png\n:width: 80%\nIt takes 300 ms.\n```") == [
        "300 ms"]
    assert flagged("H100s have twice the bf16 peak {cite:p}`nvidia`.") == []
