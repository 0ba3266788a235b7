"""``show``: the page displays code read from the source, with file and lines."""

from __future__ import annotations

import inspect

import pytest

from dtlib.chapters.show import show
from dtlib.collectives.algorithms import ring_all_reduce
from dtlib.collectives.comm_log import CommLog


def test_show_reads_the_installed_source() -> None:
    listing = show(ring_all_reduce, CommLog)
    text = repr(listing)
    assert inspect.getsource(ring_all_reduce).strip() in text
    assert "dtlib/collectives/algorithms.py, lines" in text
    html = listing._repr_html_()
    assert html.count('class="dtlib-source"') == 2
    assert 'data-qualname="CommLog"' in html


def test_show_a_line_range_and_bad_input() -> None:
    first, start = inspect.getsourcelines(ring_all_reduce)
    part = show(ring_all_reduce, lines=(1, 2)).sources[0]
    assert part.first == start and part.code.splitlines()[0].startswith("def ")
    with pytest.raises(ValueError, match="lines="):
        show(ring_all_reduce, lines=(0, 999))
    with pytest.raises(ValueError, match="no source"):
        show(len)
    with pytest.raises(ValueError, match="at least one"):
        show()


def test_show_by_markers_fails_loudly_when_the_text_is_gone() -> None:
    part = show(ring_all_reduce, start="flat = tensor",
                stop="_ring_all_gather_").sources[0]
    assert part.code.splitlines()[0].strip().startswith("flat = tensor")
    assert "_ring_all_gather_" in part.code.splitlines()[-1]
    with pytest.raises(ValueError, match="start="):
        show(ring_all_reduce, start="no such line")
    with pytest.raises(ValueError, match="stop="):
        show(ring_all_reduce, start="flat = tensor", stop="no such line")
