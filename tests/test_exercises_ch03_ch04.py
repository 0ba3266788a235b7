"""Chapters 3 and 4's exercise checkers on real ranks: each kind of wrong answer is
rejected by name, each valid alternative accepted.

The bucket hooks share one launch per world size (``hook_verdicts``): every hook
runs in its own torch DDP on the same ranks, so the file costs two launches for all
of them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.exercises import WrongAnswer

# ---- Chapter 3: the bucketed gradient hook, on 2 and 4 ranks ----------------------


def divide_first(group, bucket):
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def divide_after(group, bucket):
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    n = dist.get_world_size(group)
    return work.get_future().then(lambda fut: fut.value()[0].div_(n))


def divide_into_new_tensor(group, bucket):
    # not in place: the future's value is a new tensor, which DDP copies back
    n = dist.get_world_size(group)
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / n)


def c10d_spelling(group, bucket):
    # valid: the same all_reduce, named by the module that defines it
    import torch.distributed.distributed_c10d as c10d

    n = dist.get_world_size(group)
    fut = c10d.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(n))


def decoy_then_blocking_c10d(group, bucket):
    # a one-element async decoy, and the real all-reduce blocking under another name
    import torch.distributed.distributed_c10d as c10d

    buf = bucket.buffer().div_(dist.get_world_size(group))
    decoy = dist.all_reduce(torch.zeros(1), group=group, async_op=True)
    c10d.all_reduce(buf, group=group)
    return decoy.get_future().then(lambda f: buf)


def group_method_blocking(group, bucket):
    # the process group's own method, waited on inside the hook
    buf = bucket.buffer().div_(dist.get_world_size(group))
    (group or dist.group.WORLD).allreduce([buf]).wait()
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def divide_by_two(group, bucket):
    # right on 2 ranks only: the divisor is a constant, not the world size
    buf = bucket.buffer().div_(2)
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def world_group(group, bucket):
    # reduces over the world, not over the group DDP hands the hook
    buf = bucket.buffer().div_(dist.get_world_size(group))
    return dist.all_reduce(buf, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def world_divisor(group, bucket):
    # the group's sum, divided by the world's size
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def blocking_all_reduce(group, bucket):
    buf = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(buf, group=group)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def work_wait(group, bucket):
    buf = bucket.buffer().div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    work.wait()
    return work.get_future().then(lambda fut: fut.value()[0])


def future_wait(group, bucket):
    # blocks on the future, not on the Work: the same stall
    buf = bucket.buffer().div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    fut.wait()
    return fut.then(lambda f: f.value()[0])


def chained_future_wait(group, bucket):
    # waits on a future derived by .then(...)
    n = dist.get_world_size(group)
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    out = fut.then(lambda f: f.value()[0].div_(n))
    torch.futures.wait_all([out])
    return out


def early_value(group, bucket):
    buf = bucket.buffer().div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    done = torch.futures.Future()
    done.set_result(fut.value()[0])
    return done


def summing(group, bucket):
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def silent(group, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


RIGHT = (divide_first, divide_after, divide_into_new_tensor, c10d_spelling)
WRONG = {
    divide_by_two: (r"on 4 ranks, rank 0 \(DDP over ranks \[0, 1, 2\], one of the "
                    r"replica groups .*\): the gradients are 1.5 times the average: "
                    r"the sum was divided by 2, not by the number of ranks in the "
                    r"hook's group \(3\)"),
    world_group: r"on 4 ranks, rank 0 .*averaged over every rank of the world",
    world_divisor: (r"on 4 ranks, rank 0 .*0.75 times the average: the sum was "
                    r"divided by 4,"),
    blocking_all_reduce: r"waits for its all-reduce \(a blocking all-reduce, or a wait",
    work_wait: r"waits for its all-reduce \(a blocking all-reduce, or a wait",
    decoy_then_blocking_c10d: r"waits for its all-reduce \(a blocking all-reduce",
    group_method_blocking: r"waits for its all-reduce \(a blocking all-reduce",
    future_wait: r"waits for its all-reduce \(a wait on its future",
    chained_future_wait: r"waits for its all-reduce \(a wait on its future",
    early_value: r"reads the future's value before the all-reduce",
    summing: r"2 times too large \(the number of ranks in the hook's group\)",
    silent: "0 all-reduce calls",
}


@pytest.fixture(scope="module")
def hook_verdicts():
    from dtlib.exercises.data_parallel import hook_verdicts as verdicts

    # every hook on 2 ranks; on 4 (replica groups of 3 and 1) the first right one and
    # the ones right only when the group is the world
    hooks = [*RIGHT, *WRONG]
    out = dict(zip(hooks, verdicts(hooks, (2,))))
    on_4 = [divide_first, divide_by_two, world_group, world_divisor]
    for hook, wrong in zip(on_4, verdicts(on_4, (4,))):
        out[hook] = out[hook] or wrong
    return out


@pytest.mark.parametrize("hook", RIGHT, ids=lambda h: h.__name__)
def test_bucket_hook_accepts_each_right_hook(hook_verdicts, hook):
    assert hook_verdicts[hook] is None, hook_verdicts[hook]


@pytest.mark.parametrize("hook", list(WRONG), ids=lambda h: h.__name__)
def test_bucket_hook_rejects_each_kind_of_wrong_hook(hook_verdicts, hook):
    wrong = hook_verdicts[hook]
    assert isinstance(wrong, WrongAnswer), hook.__name__
    with pytest.raises(WrongAnswer, match=WRONG[hook]):
        raise wrong


def test_bucket_hook_checker_says_passed_and_rejects(monkeypatch, capsys) -> None:
    """The checker itself: its verdict is hook_verdicts' (launches stubbed out)."""
    from dtlib.exercises import data_parallel as dp

    verdicts = iter([[None], [WrongAnswer("no")]])
    monkeypatch.setattr(dp, "hook_verdicts", lambda hooks, ws: next(verdicts))
    dp.check_bucket_hook(divide_first)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="no"):
        dp.check_bucket_hook(divide_first)


# ---- Chapter 3: DistributedSampler's indices, built ---------------------------------

def sampler_indices(dataset_len, world_size, rank, epoch, seed):
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(dataset_len, generator=g).tolist()
    per = -(-dataset_len // world_size)
    while len(order) < per * world_size:
        order += order[:per * world_size - len(order)]
    return order[rank::world_size]


def _no_epoch(n, w, r, e, s):
    return sampler_indices(n, w, r, 0, s)


def _padding_once(n, w, r, e, s):
    # pads with indices[:padding] once: too short when padding > dataset_len
    order = torch.randperm(n, generator=torch.Generator().manual_seed(s + e)).tolist()
    per = -(-n // w)
    order += order[:per * w - n]
    return order[r::w]


def _contiguous_blocks(n, w, r, e, s):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(s + e)).tolist()
    per = -(-n // w)
    order = (order * w)[:per * w]
    return order[r * per:(r + 1) * per]


def _asks_the_sampler(n, w, r, e, s):
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=w, rank=r, seed=s)
    sampler.set_epoch(e)
    return list(sampler)


def test_sampler_indices_checker(capsys) -> None:
    from dtlib.exercises.data_parallel import check_sampler_indices

    check_sampler_indices(sampler_indices)
    assert "Correct" in capsys.readouterr().out
    for wrong, match in ((_no_epoch, "seeded with seed \\+ epoch"),
                         (_padding_once, "as many times as needed"),
                         (_contiguous_blocks, "round-robin"),
                         (_asks_the_sampler, "called `torch.*DistributedSampler.__iter__`")):
        with pytest.raises(WrongAnswer, match=match):
            check_sampler_indices(wrong)


# ---- Chapter 4: the ZeRO-2 hook accepts the list form of reduce-scatter ----------

def zero2_hook_list_form(param):
    n = dist.get_world_size()
    flat = param.grad.reshape(-1)
    shard = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter(shard, list(flat.chunk(n)))  # the list form
    param.grad_shard = shard / n
    param.grad = None


def test_zero2_hook_accepts_the_list_form(capsys) -> None:
    # reduce_scatter_single and the older name are accepted in test_exercises.py
    from dtlib.exercises.zero import check_zero2_hook

    check_zero2_hook(zero2_hook_list_form, world_sizes=(2,))
    assert "Correct" in capsys.readouterr().out
