"""Chapters 0 and 2's checkers reject each kind of wrong answer and accept the valid
alternatives: a table of world sizes, a collective under a flag, a count on one rank
only, a hard-coded world size (chapter 0); a ring that receives from any source, one
that calls a torch collective (chapter 2). Every checker here runs real ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.exercises import WrongAnswer
from dtlib.exercises.collectives import check_ring_all_gather
from dtlib.exercises.hello import check_all_reduce_prediction, check_count_flagged

# ---- chapter 0: predict an all-reduce ----------------------------------------------

PAGE_TABLE = {1: 1.0, 2: 3.0, 4: 10.0}           # the worlds the page names
LAUNCHED_TABLE = {n: n * (n + 1) / 2 for n in range(1, 8)}  # every world it launches


def test_prediction_checker_rejects_a_table_of_the_pages_world_sizes() -> None:
    with pytest.raises(WrongAnswer, match="world_size="):
        check_all_reduce_prediction(lambda n, rank: PAGE_TABLE.get(n, 0.0))


def test_prediction_checker_rejects_a_table_of_every_launched_world_size() -> None:
    # The worlds too large to launch catch a table of those it does launch.
    with pytest.raises(WrongAnswer, match="world_size="):
        check_all_reduce_prediction(lambda n, rank: LAUNCHED_TABLE.get(n, 0.0),
                                    world_sizes=(1, 2))


def test_prediction_checker_accepts_the_sum(capsys) -> None:
    # An int sum (the float form is accepted in tests/test_exercises.py).
    check_all_reduce_prediction(lambda n, rank: sum(range(1, n + 1)), seed=3)
    assert "Correct" in capsys.readouterr().out


# ---- chapter 0: count the flagged ranks, on real ranks ------------------------------

def _answers() -> dict:
    """The answers tried, defined inside a function: the ranks get them by value
    (cloudpickle) instead of importing this test module and pytest on every rank."""

    def count_by_all_reduce(flag: bool) -> int:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t)
        return int(t.item())

    def count_by_all_gather(flag: bool) -> int:
        """A valid alternative: gather every flag, count them."""
        n = dist.get_world_size()
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(parts, torch.tensor([int(flag)]))
        return int(sum(p.item() for p in parts))

    def count_under_flag(flag: bool) -> int:
        """The chapter's mistake: only the flagged ranks join the all-reduce."""
        t = torch.tensor([int(flag)])
        if flag:
            dist.all_reduce(t)
        return int(t.item())

    def count_on_rank_0_only(flag: bool) -> int:
        t = torch.tensor([int(flag)])
        dist.reduce(t, dst=0)
        return int(t.item())

    def count_for_four_ranks(flag: bool) -> int:
        t = torch.tensor([int(not flag)])
        dist.all_reduce(t)
        return 4 - int(t.item())  # the page's world size, hard-coded

    return {f.__name__: f for f in (count_by_all_reduce, count_by_all_gather,
                                    count_under_flag, count_on_rank_0_only,
                                    count_for_four_ranks)}


ANSWERS = _answers()


def test_count_checker_accepts_all_reduce_and_all_gather(capsys) -> None:
    check_count_flagged(ANSWERS["count_by_all_reduce"], seed=1)
    check_count_flagged(ANSWERS["count_by_all_gather"], world_sizes=(3,), seed=2)
    assert capsys.readouterr().out.count("Correct") == 2


@pytest.mark.parametrize("answer, world_sizes, message", [
    (lambda flag: int(flag), (2,), "expected"),             # its own flag only
    (ANSWERS["count_on_rank_0_only"], (3,), "rank [12] returned"),  # on rank 0 only
    (ANSWERS["count_for_four_ranks"], (3,), "world_size=3"),     # the page's world
])
def test_count_checker_rejects_wrong_counts(answer, world_sizes, message) -> None:
    with pytest.raises(WrongAnswer, match=message):
        check_count_flagged(answer, world_sizes=world_sizes, seed=0)


def test_count_checker_rejects_a_collective_under_the_flag() -> None:
    # The hang (or, when the unflagged ranks exit first, the flagged ones' connection
    # error) is reported as a wrong answer; a short timeout suffices, the answer hangs.
    with pytest.raises(WrongAnswer, match="on 3 ranks your count_flagged") as info:
        check_count_flagged(ANSWERS["count_under_flag"], world_sizes=(3,), seed=0,
                            timeout=4.0)
    # The report names the learner's own line (sent by value, its file is renamed
    # "<dynamic-code>"; the launcher remembers where it came from).
    assert "dist.all_reduce(t)" in str(info.value), str(info.value)


# ---- chapter 0 in Chinese: the same checks, the feedback of a Chinese learner copy ---

@pytest.fixture
def chinese(monkeypatch):
    monkeypatch.setenv("DTLIB_LANG", "zh_CN")  # what the copy's set-up cell does


def test_prediction_checker_answers_in_chinese(chinese, capsys) -> None:
    with pytest.raises(WrongAnswer, match="world_size=.*你预测的是") as info:
        check_all_reduce_prediction(lambda n, rank: PAGE_TABLE.get(n, 0.0))
    assert "all-reduce 之后每个 rank 持有相同的值" in info.value.hint
    check_all_reduce_prediction(lambda n, rank: sum(range(1, n + 1)), seed=3)
    assert "正确：" in capsys.readouterr().out


@pytest.mark.parametrize("answer, world_sizes, message", [
    (lambda flag: int(flag), (2,), "应为"),
    (ANSWERS["count_on_rank_0_only"], (3,), "rank [12] 返回了"),
    (ANSWERS["count_for_four_ranks"], (3,), "world_size=3"),
])
def test_count_checker_answers_in_chinese(chinese, answer, world_sizes, message) -> None:
    with pytest.raises(WrongAnswer, match=message) as info:
        check_count_flagged(answer, world_sizes=world_sizes, seed=0)
    assert "每个 rank 都必须调用同一个集合通信" in info.value.hint


def test_count_checker_reports_a_hang_in_chinese(chinese) -> None:
    with pytest.raises(WrongAnswer, match="在 3 个 rank 上，你的 count_flagged") as info:
        check_count_flagged(ANSWERS["count_under_flag"], world_sizes=(3,), seed=0,
                            timeout=4.0)
    assert "dist.all_reduce(t)" in str(info.value), str(info.value)


# ---- chapter 2: the ring all-gather -------------------------------------------------

# A ring all-gather whose step (the {step} lines) each variant below writes.
RING = '''
def my_all_gather(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = [torch.empty_like(tensor) for _ in range(n)]
    chunks[rank] = tensor.clone()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send, recv = (rank - step) % n, (rank - step - 1) % n
{step}
    return torch.cat(chunks)
'''

RING_ANY_SOURCE = RING.format(step="""\
        work = dist.isend(chunks[send], right)
        dist.recv(chunks[recv])          # src=None: from whoever sends, the left rank
        work.wait()""")

# Blocking calls, ordered so that a send always meets a posted receive: even ranks
# send first, odd ranks receive first (torch's send is isend + wait, seen once).
RING_BLOCKING_ORDERED = RING.format(step="""\
        if rank % 2 == 0:
            dist.send(chunks[send], right)
            dist.recv(chunks[recv], left)
        else:
            dist.recv(chunks[recv], left)
            dist.send(chunks[send], right)""")

USES_ALL_GATHER_SINGLE = '''
def my_all_gather(tensor):
    out = torch.empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]),
                      dtype=tensor.dtype)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, tensor.contiguous())
    return out
'''


# The result from a functional all-gather, behind the n - 1 sends a ring would make.
FUNCTIONAL_BEHIND_DECOYS = RING.format(step="""\
        dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send], right),
                                dist.P2POp(dist.irecv, chunks[recv], left)]
                               )[1].wait()
    import torch.distributed._functional_collectives as funcol
    chunks = list(funcol.all_gather_tensor(tensor, 0, dist.group.WORLD).chunk(n))""")


def test_ring_checker_rejects_a_functional_all_gather_behind_ring_sends() -> None:
    with pytest.raises(WrongAnswer, match=r"it calls \['all_gather'\]"):
        check_ring_all_gather(FUNCTIONAL_BEHIND_DECOYS, world_sizes=(2,))


@pytest.mark.parametrize("source", [RING_ANY_SOURCE, RING_BLOCKING_ORDERED])
def test_ring_checker_accepts_any_source_and_ordered_blocking_calls(source, capsys
                                                                     ) -> None:
    check_ring_all_gather(source, world_sizes=(2, 3), seed=4)
    assert "Correct" in capsys.readouterr().out


def test_ring_checker_rejects_torchs_one_tensor_all_gather() -> None:
    with pytest.raises(WrongAnswer, match="use only send/recv"):
        check_ring_all_gather(USES_ALL_GATHER_SINGLE, world_sizes=(2,))
