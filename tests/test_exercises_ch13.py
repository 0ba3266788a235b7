"""Chapter 13's checker: it rejects the kinds of wrong answer it names (no overlap,
perfect overlap, a wrong queue) and accepts valid alternatives."""

from __future__ import annotations

import pytest

from dtlib.exercises import WrongAnswer
from dtlib.exercises import step_time as st


def _queue(forward_s, backward_s, buckets_s):
    k, free = len(buckets_s), 0.0
    for i, c in enumerate(buckets_s):
        free = max(forward_s + (i + 1) * backward_s / k, free) + c
    return max(free, forward_s + backward_s)


def _closed_form(forward_s, backward_s, buckets_s):
    # the same queue written as a max over which bucket starts the final run
    k = len(buckets_s)
    return max([forward_s + backward_s] + [
        forward_s + (i + 1) * backward_s / k + sum(buckets_s[i:]) for i in range(k)])


def _no_overlap(forward_s, backward_s, buckets_s):
    return forward_s + backward_s + sum(buckets_s)


def _perfect_overlap(forward_s, backward_s, buckets_s):
    return max(forward_s + backward_s, sum(buckets_s))


def _last_bucket_only(forward_s, backward_s, buckets_s):
    return forward_s + backward_s + buckets_s[-1]


@pytest.mark.parametrize("answer", [_queue, _closed_form])
def test_overlapped_ddp_accepts(answer, capsys) -> None:
    st.check_overlapped_ddp(answer)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [(_no_overlap, "added every bucket"),
                                         (_perfect_overlap, "perfect overlap"),
                                         (_last_bucket_only, "too")])
def test_overlapped_ddp_rejects(wrong, says) -> None:
    with pytest.raises(WrongAnswer, match=says):
        st.check_overlapped_ddp(wrong)
