"""torchft's DiLoCo and LocalSGD (``torchft.local_sgd``) against ours, on CPU gloo.

Two replica groups, each one process (``launch.spawn`` starts them under its timeout
and kills them on failure), find each other through a torchft lighthouse served from
this process (``LighthouseServer``, the Rust server inside torchft's wheel: no binary
to start). Each replica group hosts its own TCPStore and runs a torchft ``Manager``
over a reconfigurable ``ProcessGroupGloo``, all on localhost with ephemeral ports and
a timeout on every wait. Each trains Chapter 6's GPT with SGD and momentum on its
half of every global batch through the one loop (``run_steps``, one process's
``Parallelism``); torchft's wrapper hooks the inner optimizer's step.
``simulate_diloco`` is ours, on one process.

What torchft does, and what makes the comparison faithful:

- ``DiLoCo`` with one fragment, ``fragment_sync_delay=0`` and
  ``fragment_update_alpha=0`` is ours. After ``sync_every`` inner steps (the first
  outer step after H steps, as ours) the pseudo-gradient is ``backup - params``
  (our ``anchor - params``, the same sign); the Manager's all-reduce sums it (gloo
  SUM, one all-reduce per parameter) and divides by the participants (an average, as
  ours); the parameters are restored to the backup, the outer optimizer (we build it:
  SGD, Nesterov, over the model's own parameters, which stand in for our separate
  anchor) steps them with it as their gradient, and the result is the new backup;
  ``lerp_(local, 0)`` leaves it as is. The inner optimizer keeps its state across
  outer steps, as ours. What torchft adds: Streaming DiLoCo's fragments (each synced
  at its own offset), a delayed sync that overlaps the all-reduce with ``tau`` inner
  steps, alpha-mixing of local and global parameters, and an outer step that is
  discarded (parameters back to the backup) when a replica fails.
- ``LocalSGD`` averages the *parameters* every ``sync_every`` steps: our DiLoCo with
  an outer SGD of lr 1 and no momentum, ``a - mean(a - p_i)``, which is ``mean(p_i)``
  in exact arithmetic.
- The Manager's default ``init_sync=True`` makes every replica but the primary heal
  from it at the first quorum, and DiLoCo asks for its first quorum only at its first
  outer step: replica 1's first H inner steps are replaced by replica 0's model and
  optimizer state. Ours starts every replica from the same seeded model, which is
  what ``init_sync=False`` is for (torchft's docstring says so). The last test shows
  the difference.

Tolerances: each replica's inner steps are the same kernels on the same rows as the
simulation's (the simulation runs at the ranks' thread count: a CPU matmul's blocking,
hence its rounding, depends on it), so only the outer step's arithmetic can differ.

- DiLoCo: the all-reduce sums the n pseudo-gradients in its own order, (n - 1) eps of
  their summed magnitudes per outer step for n > 2 (``test_diloco``'s bound). For
  n = 2 there is no order: a + b is commutative and correctly rounded; halving is
  exact; the outer SGD is the same kernel on the same values. So the parameters and
  losses are equal, bit for bit.
- LocalSGD: ``fl(p0 + p1) / 2`` against ``fl(a - fl(fl(a - p0) + fl(a - p1)) / 2)``:
  each rounding at most eps/2 of its result, under eps (summed pseudo-gradient
  magnitudes + largest parameter) per outer step, doubled for the feedback into the
  next rounds' inner steps (as Chapter 6's SGD bound is), summed over the rounds.
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("torchft", reason="needs torchft (pip install torchft==0.2.0)")

import torch  # noqa: E402

from test_pipeline_parallel import loss_rel  # noqa: E402

from dtlib.chapters.ch06_pipeline_parallel.runs import OPTIMIZER, PP_GPT  # noqa: E402
from dtlib.data_parallel.parallelism import rows_of_rank  # noqa: E402
from dtlib.low_comm import simulate_diloco  # noqa: E402
from dtlib.models.gpt import GPTConfig, build_gpt  # noqa: E402
from dtlib.models.reference import gpt_batches  # noqa: E402
from dtlib.models.run import Parallelism, RunConfig, TrainState, run_steps  # noqa: E402
from dtlib.runtime import launch  # noqa: E402

BATCH = 8
REPLICAS = 2
H, ROUNDS = 3, 2
#: seconds any torchft wait (quorum, store, all-reduce, heal) may take before it raises
WAIT_S = 20


def _replica(lighthouse: str, algorithm: str, outer_lr: float, outer_momentum: float,
             init_sync: bool) -> dict:
    """On every rank: one replica group of one process under torchft's
    ``algorithm`` ("diloco" or "local_sgd"); the parameters after H * ROUNDS steps."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo as FTDiLoCo, LocalSGD
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    replica = dist.get_rank()  # which replica group this process is (spawn's world)
    cfg = GPTConfig(**PP_GPT)
    opt = dict(OPTIMIZER)
    kind = opt.pop("optimizer_class")
    model = build_gpt(cfg, seed=0)
    inner = kind(model.parameters(), **opt)

    # what a replica that heals from a peer loads (torchft's DiLoCo adds its backup
    # of the anchor and the outer optimizer's state)
    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    wait = timedelta(seconds=WAIT_S)
    # the replica group's own store (its world of one); the replicas' gloo group
    # rendezvouses through the primary's store, under a per-quorum prefix
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=wait),
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=REPLICAS, use_async_quorum=False,
                      init_sync=init_sync, replica_id=f"replica_{replica}",
                      store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=lighthouse, hostname="localhost",
                      timeout=wait, quorum_timeout=wait, connect_timeout=wait)
    try:
        if algorithm == "diloco":
            outer = torch.optim.SGD(model.parameters(), lr=outer_lr,
                                    momentum=outer_momentum,
                                    nesterov=outer_momentum > 0)
            wrapper = FTDiLoCo(manager, [model], inner, outer, sync_every=H)
        else:
            wrapper = LocalSGD(manager, model, inner, sync_every=H)
        batches = gpt_batches(cfg, BATCH)
        config = RunConfig(H * ROUNDS, optimizer_class=kind, optimizer_kwargs=opt,
                           record_grads=False)
        with wrapper:
            res = run_steps(Parallelism(), None,
                            lambda k: rows_of_rank(batches(k), replica, REPLICAS),
                            config, TrainState(wrapped=model, optimizer=inner))
        return {"params": res.params, "losses": res.losses,
                "outer_steps": manager.current_step()}
    finally:
        manager.shutdown(wait=False)


def _torchft(algorithm: str, outer_lr: float, outer_momentum: float,
             init_sync: bool = False) -> list[dict]:
    """Both replicas' results; the lighthouse lives exactly as long as the launch."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=REPLICAS)
    try:
        port = server.address().rsplit(":", 1)[1]  # it names the host's hostname
        return launch.spawn(_replica, REPLICAS, f"http://localhost:{port}", algorithm,
                            outer_lr, outer_momentum, init_sync, backend="gloo",
                            stream=False, timeout=60)
    finally:
        server.shutdown()


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ours(outer_lr: float, outer_momentum: float) -> dict:
    cfg = GPTConfig(**PP_GPT)
    opt = dict(OPTIMIZER)
    with _threads(launch.threads_per_rank(REPLICAS)):  # the ranks' kernels
        return simulate_diloco(build_gpt(cfg, seed=0), gpt_batches(cfg, BATCH),
                               H * ROUNDS, REPLICAS, H, outer_lr, outer_momentum,
                               opt.pop("optimizer_class"), **opt)


def _local_sgd_atol(sim: dict) -> float:
    """The module docstring's LocalSGD bound."""
    eps = torch.finfo(torch.float32).eps
    return 2 * ROUNDS * eps * (sim["max_delta_sum"] + sim["max_param"])


def _moved(sim: dict) -> float:
    start = build_gpt(GPTConfig(**PP_GPT), seed=0).state_dict()
    return max((sim["params"][n] - start[n]).abs().max().item() for n in sim["params"])


def _worst(ranks: list[dict], sim: dict) -> float:
    return max((q - sim["params"][n]).abs().max().item()
               for r in ranks for n, q in r["params"].items())


def _mean_losses(ranks: list[dict]) -> list[float]:
    """A step's loss: the mean of the replicas' losses on their halves of the
    batch (in float64, as the simulation averages them: exact halves)."""
    return [sum(ls) / REPLICAS for ls in zip(*(r["losses"] for r in ranks))]


def test_torchft_diloco_equals_ours_bit_for_bit() -> None:
    ranks = _torchft("diloco", 0.7, 0.9)
    sim = _ours(0.7, 0.9)
    for r in ranks:
        assert r["outer_steps"] == ROUNDS  # every outer step committed
        assert r["params"].keys() == sim["params"].keys()
        for n, q in r["params"].items():
            assert torch.equal(q, sim["params"][n]), n
    assert _mean_losses(ranks) == sim["losses"]
    # not vacuous: the outer steps moved the anchor (by far more than a rounding)
    assert _moved(sim) > 1e3 * _local_sgd_atol(sim)


def test_torchft_local_sgd_is_diloco_with_a_plain_outer_step() -> None:
    ranks = _torchft("local_sgd", 1.0, 0.0)
    sim = _ours(1.0, 0.0)
    atol = _local_sgd_atol(sim)
    for r in ranks:
        assert r["outer_steps"] == ROUNDS
        for n, q in r["params"].items():
            torch.testing.assert_close(q, sim["params"][n], rtol=0, atol=atol, msg=n)
    # the losses of the rounds after the first see parameters within atol
    torch.testing.assert_close(_mean_losses(ranks), sim["losses"], atol=0,
                               rtol=loss_rel(BATCH))
    assert _moved(sim) > 1e3 * atol
    # and it is not DiLoCo's Nesterov step
    assert _worst(ranks, _ours(0.7, 0.9)) > 1e3 * atol


def test_init_sync_replaces_a_replicas_first_round() -> None:
    # the Manager's default: replica 1 heals from replica 0 at the first outer step,
    # so that step averages replica 0's pseudo-gradient with itself
    ranks = _torchft("diloco", 0.7, 0.9, init_sync=True)
    sim = _ours(0.7, 0.9)
    assert _worst(ranks, sim) > 1e3 * _local_sgd_atol(sim)
    first = _mean_losses(ranks)[:H]
    assert first == sim["losses"][:H]  # the first H steps are trained as ours
