"""Checkers for Chapter 2, "Collectives": answers are checked on real ranks.

A function written in a notebook cell cannot be imported by the ranks that
:func:`dtlib.runtime.launch.spawn` forks (it lives in the kernel's ``__main__``). So the
all-gather checker sends the function's *source* (``inspect.getsource``) to every rank,
which executes it in a fresh namespace holding ``torch`` and ``dist``. The function
must therefore be self-contained: it may use ``torch``, ``dist`` (torch.distributed)
and anything it imports itself, not other variables of the notebook.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.runtime import launch
from dtlib.exercises import WrongAnswer, passed

_CASES = ((4,), (3, 2), (1,), (5, 3))  # shard shapes, one per check


def _load(source: str, name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"torch": torch, "dist": dist}
    exec(compile(source, f"<your {name}>", "exec"), namespace)  # noqa: S102
    if not callable(namespace.get(name)):
        raise WrongAnswer(f"the source defines no function named {name!r}")
    return namespace[name]


def _check_all_gather_on_rank(source: str, name: str) -> list[str]:
    """On every rank: run the learner's all-gather on several shapes; list problems."""
    from dtlib.collectives.accounting import count_comms

    fn = _load(source, name)
    rank, n = dist.get_rank(), dist.get_world_size()
    problems = []
    for shape in _CASES:
        shard = torch.arange(torch.Size(shape).numel(), dtype=torch.int64
                             ).reshape(shape) + 100 * rank
        want = torch.cat([torch.arange(shard.numel()).reshape(shape) + 100 * r
                          for r in range(n)])
        with count_comms(functional=False) as log:
            got = fn(shard.clone())
        used = {r.op for r in log.records} - {"send", "recv"}
        if used:
            problems.append(f"it calls {sorted(used)}: use only send/recv "
                            "(dist.send, dist.recv, dist.isend, dist.irecv)")
            break
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or \
                not torch.equal(got, want):
            problems.append(
                f"world_size={n}, rank {rank}, shard shape {tuple(shape)}: expected "
                f"{want.flatten().tolist()} (shape {tuple(want.shape)}), got "
                f"{got.flatten().tolist() if isinstance(got, torch.Tensor) else got!r}"
                + (f" (shape {tuple(got.shape)})" if isinstance(got, torch.Tensor)
                   else ""))
            break
    return problems


def check_ring_all_gather(fn: Callable[..., Any] | str,
                          world_sizes: tuple[int, ...] = (1, 2, 3, 4),
                          timeout: float = 30.0) -> None:
    """Check a learner's ``fn(tensor) -> tensor``: all-gather along dim 0 by send/recv.

    Args:
        fn: the function, or its source text (then its name is the first ``def``).
        world_sizes: worlds to run it in.
        timeout: seconds before a hung attempt is stopped (and reported as a deadlock).
    """
    if callable(fn):
        source, name = textwrap.dedent(inspect.getsource(fn)), fn.__name__
    else:
        source = textwrap.dedent(fn)
        line = next((ln for ln in source.splitlines() if ln.startswith("def ")), None)
        if line is None:
            raise WrongAnswer("the source has no top-level 'def'")
        name = line[4:].split("(")[0].strip()
    _load(source, name)  # syntax errors surface here, in the learner's process
    for n in world_sizes:
        try:
            results = launch.spawn(_check_all_gather_on_rank, n, source, name,
                                   timeout=timeout, stream=False)
        except launch.LaunchTimeout as exc:
            raise WrongAnswer(
                f"world_size={n}: your all-gather did not finish in {timeout:g} s: a "
                "deadlock? Post the send and the receive of a step together (isend + "
                "irecv, then wait both).\n" + "\n".join(exc.report)) from None
        except launch.LaunchError as exc:
            raise WrongAnswer(f"world_size={n}: your all-gather raised on a rank:\n"
                              f"{exc}") from None
        problems = [p for per_rank in results for p in per_rank]
        if problems:
            raise WrongAnswer(problems[0] + ". Hint: in step s, rank r sends the "
                              "chunk of rank (r - s) mod n to rank r+1 and receives "
                              "the chunk of rank (r - s - 1) mod n from rank r-1.")
    passed(f"your ring all-gather equals all_gather on {list(world_sizes)} ranks, "
           "using send/recv only")


def _ring_bytes_sent(nbytes: int) -> int:
    from dtlib.collectives.accounting import count_comms
    from dtlib.collectives.algorithms import ring_all_reduce

    with count_comms(functional=False) as log:
        ring_all_reduce(torch.ones(nbytes // 4))
    return log.total_bytes("send")


def check_bytes_sent(predict: Callable[[int, int], float],
                     cases: tuple[tuple[int, int], ...] = ((4800, 2), (4800, 3),
                                                           (4800, 4), (96, 4))) -> None:
    """Check ``predict(nbytes, world_size)``: bytes a rank sends in a ring all-reduce.

    The truth is counted on real ranks (``count_comms`` around
    :func:`dtlib.collectives.ring_all_reduce` of a float32 tensor of ``nbytes``).
    """
    for nbytes, n in cases:
        sent = launch.spawn(_ring_bytes_sent, n, nbytes, stream=False)
        got = predict(nbytes, n)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise WrongAnswer(f"predict({nbytes}, {n}) returned {got!r}: "
                              "return a number")
        if any(abs(got - s) > 1e-6 * max(1, s) for s in sent):
            raise WrongAnswer(
                f"all-reduce of {nbytes} bytes on {n} ranks: you predicted {got!r} "
                f"bytes per rank, the ranks sent {sent}. Hint: count the steps of the "
                "reduce-scatter and of the all-gather, and the size of the chunk sent "
                "in each.")
    passed("your prediction matches the bytes each rank sent, for every case")
