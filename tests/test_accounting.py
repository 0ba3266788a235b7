"""count_comms sees every collective, however it is called: one recorder for all."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from dtlib.collectives.accounting import CommLog, CommRecord, count_comms
from dtlib.models.gpt import MLP
from dtlib.runtime import launch


def _plain_ops() -> list[tuple]:
    n = dist.get_world_size()
    x = torch.arange(12, dtype=torch.float32)           # 48 bytes
    with count_comms() as log:
        dist.all_reduce(x)
        dist.distributed_c10d.broadcast(x, src=0)       # the other namespace
        out = torch.empty(12 * n)
        dist.all_gather_into_tensor(out, x)             # counted once, not twice
        dist.reduce_scatter_tensor(torch.empty(12 // n), x)
        with count_comms() as inner:                    # nested: both logs see it
            dist.all_to_all_single(torch.empty(12), x)
        dist.barrier()
    return [(r.op, r.numel, r.bytes, r.group_size, r.source) for r in log.records] + [
        ("inner", inner.calls(), inner.total_bytes()), ("summary", log.summary())]


def test_dist_calls_in_both_namespaces_are_recorded_once(
        two_ranks: list[dict]) -> None:
    got = two_ranks[0]["plain"]
    src = "c10d"
    assert got[:6] == [("all_reduce", 12, 48, 2, src), ("broadcast", 12, 48, 2, src),
                       ("all_gather", 24, 96, 2, src),
                       ("reduce_scatter", 12, 48, 2, src),
                       ("all_to_all", 12, 48, 2, src), ("barrier", 0, 0, 2, src)]
    assert got[6] == ("inner", 1, 48)
    assert got[7] == ("summary", [
        {"op": "all_reduce", "calls": 1, "bytes": 48},
        {"op": "broadcast", "calls": 1, "bytes": 48},
        {"op": "all_gather", "calls": 1, "bytes": 96},
        {"op": "reduce_scatter", "calls": 1, "bytes": 48},
        {"op": "all_to_all", "calls": 1, "bytes": 48},
        {"op": "barrier", "calls": 1, "bytes": 0}])


def _spellings() -> dict[str, object]:
    """The same all-reduce written every way torch allows, and what else is recorded."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, object] = {}
    spellings = {
        "dist": lambda t: dist.all_reduce(t),
        "c10d": lambda t: c10d.all_reduce(t),
        "group_method": lambda t: dist.group.WORLD.allreduce([t]).wait(),
        "async_then_wait": lambda t: dist.all_reduce(t, async_op=True).wait(),
        "functional": lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD).wait(),
    }
    for name, call in spellings.items():
        with count_comms() as log:
            call(torch.ones(5))
        out[name] = [(r.op, r.numel, r.dtype) for r in log.records]
    # A polling loop instead of a wait: the work still answers is_completed().
    with count_comms() as log:
        work = dist.all_reduce(torch.ones(3), async_op=True)
        while not work.is_completed():
            pass
    out["polled"] = (log.calls(), log.events)
    # Point to point, with peers (global ranks), one message each way.
    with count_comms() as log:
        ops = [dist.P2POp(dist.isend, torch.ones(2, dtype=torch.bfloat16),
                          (rank + 1) % n),
               dist.P2POp(dist.irecv, torch.empty(2, dtype=torch.bfloat16),
                          (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    out["p2p"] = [(r.op, r.peer, r.dtype, r.bytes) for r in log.records]
    out["p2p_waited"] = [log.waited(r) for r in log.records]
    # An async all-reduce never waited on in the block: recorded, not waited.
    with count_comms() as log:
        late = dist.all_reduce(torch.ones(4), async_op=True)
    late.wait()  # after the block: still completes (the work outlives the block)
    out["unwaited"] = [log.waited(r) for r in log.records]
    # Another thread's collectives are not this block's (a dispatch mode is per thread).
    with count_comms() as log:
        thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)))
        thread.start()
        thread.join()
    out["other_thread"] = log.calls()
    # A gated future completes only once its gate does; wait() is never held.
    gates: list = []

    def gate(rec: CommRecord) -> torch.futures.Future:
        gates.append(torch.futures.Future())
        return gates[-1]

    with count_comms(future_gate=gate) as log:
        fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
        held = not fut.done()
        gates[0].set_result(None)
        fut.wait()
    out["gate"] = (held, fut.done(), [kind for kind, _ in log.events])
    return out


def test_every_spelling_of_a_collective_is_one_record(two_ranks: list[dict]) -> None:
    got = two_ranks[0]["spellings"]
    for name in ("dist", "c10d", "group_method", "async_then_wait", "functional"):
        assert got[name] == [("all_reduce", 5, "torch.float32")], name
    calls, events = got["polled"]
    assert calls == 1 and [kind for kind, _ in events] == ["issue"]  # never waited
    for rank, res in enumerate(two_ranks):
        peer_next, peer_prev = (rank + 1) % 2, (rank - 1) % 2
        assert res["spellings"]["p2p"] == [("send", peer_next, "torch.bfloat16", 4),
                                           ("recv", peer_prev, "torch.bfloat16", 4)]
        assert res["spellings"]["p2p_waited"] == [True, True]
    assert got["unwaited"] == [False]
    assert got["other_thread"] == 0
    assert got["gate"] == (True, True, ["issue", "future"])
def test_commlog_totals_and_validation() -> None:
    log = CommLog([CommRecord("all_reduce", 10, 40, 4, "x"),
                   CommRecord("all_gather", 8, 16, 4, "x"),
                   CommRecord("all_reduce", 5, 20, 4, "x")])
    assert log.calls() == 3 and log.calls("all_reduce") == 2
    assert log.total_bytes("all_reduce") == 60 and log.total_numel() == 23
    assert log.summary() == [{"op": "all_reduce", "calls": 2, "bytes": 60},
                             {"op": "all_gather", "calls": 1, "bytes": 16}]
    with pytest.raises(ValueError, match="op='allreduce'"):
        log.calls("allreduce")


def _ddp_step() -> tuple[int, int, int]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(MLP((16, 64, 64, 8)))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(4, 16)
    with count_comms() as log:
        model(x).square().mean().backward()
    return log.total_bytes("all_reduce"), grad_bytes, log.calls("all_reduce")


def test_ddp_step_all_reduces_the_gradient_bytes(two_ranks: list[dict]) -> None:
    # DDP's C++ reducer calls the process group, which passes the dispatcher.
    for total, grad_bytes, calls in (r["ddp"] for r in two_ranks):
        assert total == grad_bytes and calls >= 1


def _fsdp2_step() -> tuple[int, int, int, int, int]:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    torch.manual_seed(0)
    model = MLP((16, 64, 64, 8))
    n_params = sum(p.numel() for p in model.parameters())
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    x = torch.randn(4, 16)
    with count_comms() as log:
        model(x).square().mean().backward()
    # reshard_after_forward: each layer is gathered in forward and again in backward;
    # each layer's gradients are reduce-scattered once.
    return (log.total_numel("all_gather"), log.total_numel("reduce_scatter"),
            log.calls("all_gather"), log.calls("reduce_scatter"), n_params)


def test_fsdp2_all_gather_and_reduce_scatter_volumes(two_ranks: list[dict]) -> None:
    for ag, rs, ag_calls, rs_calls, n_params in (r["fsdp2"] for r in two_ranks):
        # Each message is the padded flat parameters of one layer: at least the
        # parameters, at most one extra element per rank per tensor of padding.
        assert ag_calls == 6 and rs_calls == 3
        assert 2 * n_params <= ag <= 2 * n_params + 6 * 2
        assert n_params <= rs <= n_params + 6 * 2


def _functional() -> list[tuple]:
    import torch.distributed._functional_collectives as funcol

    x = torch.ones(6)
    group = dist.group.WORLD
    with count_comms() as log:
        funcol.all_reduce(x, "sum", group).wait()
        funcol.all_gather_tensor(x, 0, group).wait()
    return [(r.op, r.numel, r.group_size, r.source) for r in log.records]


def test_functional_collectives_are_recorded(two_ranks: list[dict]) -> None:
    got = two_ranks[0]["functional"]
    assert got == [("all_reduce", 6, 2, "functional"),
                   ("all_gather", 12, 2, "functional")]


def _all_cases() -> dict[str, object]:
    """Every rank function above, in one process group (one launch for the file)."""
    return {"plain": _plain_ops(), "spellings": _spellings(), "ddp": _ddp_step(),
            "fsdp2": _fsdp2_step(), "functional": _functional()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """One 2-rank launch whose results every multi-rank test here reads."""
    return launch.spawn(_all_cases, 2, stream=False)
