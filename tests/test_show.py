"""``show``: the page displays code read from the source, with file and lines."""

from __future__ import annotations

import inspect

import pytest

from dtlib.chapters.show import show
from dtlib.tensor_parallel.mappings import CopyToParallelRegion
from dtlib.zero.stage3 import install_stage3_hooks


def test_show_reads_the_installed_source() -> None:
    listing = show(install_stage3_hooks, CopyToParallelRegion)
    text = repr(listing)
    assert inspect.getsource(install_stage3_hooks).strip() in text
    assert "dtlib/zero/stage3.py, lines" in text
    html = listing._repr_html_()
    assert html.count('class="dtlib-source"') == 2
    assert 'data-qualname="CopyToParallelRegion"' in html


def test_show_a_line_range_and_bad_input() -> None:
    first, start = inspect.getsourcelines(install_stage3_hooks)
    part = show(install_stage3_hooks, lines=(1, 2)).sources[0]
    assert part.first == start and part.code.splitlines()[0].startswith("def ")
    with pytest.raises(ValueError, match="lines="):
        show(install_stage3_hooks, lines=(0, 999))
    with pytest.raises(ValueError, match="no source"):
        show(len)
    with pytest.raises(ValueError, match="at least one"):
        show()


def test_show_by_markers_fails_loudly_when_the_text_is_gone() -> None:
    part = show(install_stage3_hooks, start="for unit in", stop="gather_flat").sources[0]
    assert part.code.splitlines()[0].strip().startswith("for unit in")
    assert "gather_flat" in part.code.splitlines()[-1]
    with pytest.raises(ValueError, match="start="):
        show(install_stage3_hooks, start="no such line")
    with pytest.raises(ValueError, match="stop="):
        show(install_stage3_hooks, start="for unit in", stop="no such line")
