"""Rank functions and single-process references for Chapter 12 (and its tests).

- :func:`ring_check` / :func:`attention_reference`: ring attention on the ranks vs
  full attention on one process, forward and backward, bytes counted;
- :func:`ulysses_check`: the all-to-all alternative, the same way;
- :func:`torch_cp_probe`: does torch's experimental ``context_parallel`` run here?
- :func:`sp_block_run` / :func:`block_reference`: one transformer block, tensor
  parallel (Chapter 5) or sequence parallel, vs one process; communication and
  activation bytes per rank;
- :func:`train_cp`: the whole GPT trained with context parallelism (the one loop);
  :func:`probe_and_train_cp` launches it with the probe.

Taught in: Chapter 12, long sequences.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtlib.chapters.ch06_pipeline_parallel.runs import train_pipeline
from dtlib.collectives.accounting import count_comms
from dtlib.context_parallel import cp_shard, cp_unshard, ring_attention
from dtlib.context_parallel import parallelism as cp_parallelism
from dtlib.context_parallel.ulysses import ulysses_attention
from dtlib.memory.measure import measure_activations
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches, grads_of
from dtlib.models.run import RunConfig, RunResult, run_steps
from dtlib.pipeline_parallel.parallelism import TORCH_SCHEDULES
from dtlib.runtime import dist as ddist
from dtlib.tensor_parallel.gpt import full_tensors, tensor_parallelize
from dtlib.tensor_parallel.mappings import tp_rank, tp_size
from dtlib.tensor_parallel.sequence_parallel import (
    allreduce_sequence_parallel_grads, gather_from_sp, sequence_parallel_block)

#: batch, heads, full sequence, head dim of the attention checks
SHAPE = (2, 3, 16, 8)


def attention_inputs(shape: tuple[int, int, int, int] = SHAPE, seed: int = 0
                     ) -> list[torch.Tensor]:
    """q, k, v and an output gradient ``dout``, full sequence, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(4)]


def attention_reference(causal: bool, shape: tuple[int, int, int, int] = SHAPE
                        ) -> dict[str, torch.Tensor]:
    """One process: ``scaled_dot_product_attention`` over the whole sequence.

    Returns:
        ``{"out", "dq", "dk", "dv"}`` for the inputs of :func:`attention_inputs`.
    """
    q, k, v, dout = attention_inputs(shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _sharded_run(attention: Any, op: str, causal: bool,
                 shape: tuple[int, int, int, int]) -> dict[str, Any]:
    """``attention`` on this rank's load-balanced chunks, forward and backward, with
    the bytes of ``op`` counted in each; full results unsharded on CPU."""
    device = ddist.world().device
    q, k, v, dout = (cp_shard(t.to(device), 2) for t in attention_inputs(shape))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with count_comms() as fwd:
        out = attention(q, k, v, causal=causal)
    with count_comms() as bwd:
        out.backward(dout)
    return {**{name: cp_unshard(t, 2).cpu() for name, t in
               (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))},
            "fwd_bytes": fwd.total_bytes(op), "bwd_bytes": bwd.total_bytes(op),
            "fwd_recv": fwd.total_bytes("recv")}


def ring_check(causal: bool, shape: tuple[int, int, int, int] = SHAPE
               ) -> dict[str, Any]:
    """One rank: ring attention on its load-balanced chunks, forward and backward.

    Returns:
        The full (unsharded) ``out, dq, dk, dv`` on CPU, the bytes this rank sent in
        forward and in backward (``fwd_bytes``, ``bwd_bytes``) and received in forward
        (``fwd_recv``), and the message of the ``ValueError`` that ``cp_shard`` raises
        for a sequence not divisible by ``2 * cp`` (``bad``).
    """
    res = _sharded_run(ring_attention, "send", causal, shape)
    try:
        size = 2 * ddist.world().world_size + 2
        cp_shard(torch.zeros(1, size, device=ddist.world().device), 1)
        res["bad"] = None
    except ValueError as exc:
        res["bad"] = str(exc)
    return res


def ulysses_check(causal: bool, shape: tuple[int, int, int, int] = (2, 4, 16, 8)
                  ) -> dict[str, Any]:
    """One rank: DeepSpeed-Ulysses attention on its chunks, forward and backward.

    Returns:
        The full ``out, dq, dk, dv`` on CPU and the all-to-all bytes this rank issued
        in forward and in backward (``fwd_bytes``, ``bwd_bytes``: message sizes as
        torch counts them, the whole input of each call).
    """
    return _sharded_run(ulysses_attention, "all_to_all", causal, shape)


def attention_checks(causal: bool, shape: tuple[int, int, int, int] = (2, 4, 16, 8)
                     ) -> dict[str, Any]:
    """One rank: :func:`ring_check` and :func:`ulysses_check` in one launch."""
    return {"ring": ring_check(causal, shape), "ulysses": ulysses_check(causal, shape)}


def torch_cp_probe(shape: tuple[int, int, int, int] = SHAPE) -> dict[str, Any]:
    """One rank: try torch's ``context_parallel`` on this rank's device.

    Returns:
        ``{"ran": bool, "error": "Type: message" or None, "max_diff": float or None}``
        (``max_diff``: against full attention, when it ran).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (
        context_parallel_unshard)

    world = ddist.world()
    mesh = init_device_mesh(world.device.type, (world.world_size,))
    q, k, v, _ = (t.to(world.device) for t in attention_inputs(shape))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (full,) = context_parallel_unshard(mesh, [out], [2])
        return {"ran": True, "error": None,
                "max_diff": (full - ref).abs().max().item()}
    except Exception as exc:  # the finding is the exception itself
        return {"ran": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                "max_diff": None}


def _block_inputs(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, cfg.seq_len, cfg.hidden, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def block_reference(cfg: GPTConfig, batch: int, seed: int = 0) -> dict[str, Any]:
    """One process: block 0 of ``build_gpt(cfg, seed)``, forward and backward.

    Returns:
        ``{"out", "dx", "grads" (by name, "blocks.0." prefix), "act_bytes"}``.
    """
    model = build_gpt(cfg, seed)
    block = model.blocks[0]
    x, dout = _block_inputs(cfg, batch, seed)
    act = measure_activations(block, x).activations
    x.requires_grad_()
    y = block(x)
    y.backward(dout)
    return {"out": y.detach(), "dx": x.grad, "act_bytes": act,
            "grads": {f"blocks.0.{n}": g for n, g in grads_of(block).items()}}


def sp_block_run(cfg: GPTConfig, batch: int, sequence_parallel: bool,
                 seed: int = 0, allreduce_grads: bool = True) -> dict[str, Any]:
    """One rank: block 0 tensor parallel (Chapter 5) or sequence parallel on top.

    With sequence parallelism the block takes and returns this rank's ``s / t``
    tokens; outputs and input gradients are all-gathered for the comparison, and the
    partial gradients of the LayerNorms and row biases all-reduced
    (``allreduce_grads=False`` leaves them partial: the mistake the tests plant).

    Returns:
        ``{"out", "dx", "grads" (full, by name), "act_bytes" (saved for backward on
        this rank), "comms": {"forward": summary, "backward": summary}}``.
    """
    device = ddist.world().device
    model = build_gpt(cfg, seed).to(device)
    tensor_parallelize(model)
    block = model.blocks[0]
    x, dout = (t.to(device) for t in _block_inputs(cfg, batch, seed))
    if sequence_parallel:
        sequence_parallel_block(block)
        t, r = tp_size(), tp_rank()
        x, dout = (z.chunk(t, dim=1)[r].contiguous() for z in (x, dout))
    act = measure_activations(block, x).activations
    x.requires_grad_()
    with count_comms() as fwd:
        y = block(x)
    with count_comms() as bwd:
        y.backward(dout)
    if sequence_parallel:
        if allreduce_grads:
            allreduce_sequence_parallel_grads(block)
        with torch.no_grad():
            y, dx = gather_from_sp(y.detach()), gather_from_sp(x.grad)
    else:
        dx = x.grad
    grads = {n: g for n, g in full_tensors(model, grads=True).items()
             if n.startswith("blocks.0.")}
    return {"out": y.detach().cpu(), "dx": dx.cpu(), "grads": grads,
            "act_bytes": act,
            "comms": {"forward": fwd.summary(), "backward": bwd.summary()}}


def train_cp(cfg: GPTConfig, batch: int, steps: int, lr: float = 1e-3,
             seed: int = 0, optimizer_class: type = torch.optim.AdamW,
             **optimizer_kwargs: Any) -> RunResult:
    """One rank of context-parallel training of the GPT of ``reference_gpt_run``.

    Every rank builds the same model and sees the same batch; it keeps its
    load-balanced share of the tokens, attends through the ring, and averages
    gradients over the ranks before each optimizer step: the one loop with
    :func:`dtlib.context_parallel.parallelism`.

    Args:
        cfg, batch, steps, lr, seed, optimizer_class, optimizer_kwargs: as
            ``reference_gpt_run``.
    Returns:
        The :class:`~dtlib.models.run.RunResult`: ``losses`` (global loss per step),
        ``grads`` (first step's), ``params`` (after the last step), CPU, by name.

    Taught in: Chapter 12, "A GPT trained with context parallelism".
    """
    device = ddist.world().device
    return run_steps(cp_parallelism(), build_gpt(cfg, seed).to(device),
                     gpt_batches(cfg, batch, device),
                     RunConfig(steps, optimizer_class=optimizer_class,
                               optimizer_kwargs={"lr": lr, **optimizer_kwargs}))


def probe_and_train_cp(cfg: GPTConfig, batch: int, steps: int, **optimizer: Any
                       ) -> dict[str, Any]:
    """One rank, one launch: :func:`torch_cp_probe`, then :func:`train_cp`.

    Args:
        cfg, batch, steps, optimizer: as :func:`train_cp` (``lr``,
            ``optimizer_class`` and its keyword arguments).
    Returns:
        ``{"probe": torch_cp_probe(), "cp": train_cp(...)}``.

    Taught in: Chapter 12, "Context parallelism".
    """
    return {"probe": torch_cp_probe(), "cp": train_cp(cfg, batch, steps, **optimizer)}


def tp_and_sp_block(cfg: GPTConfig, batch: int, seed: int = 0) -> dict[str, Any]:
    """One rank: :func:`sp_block_run` without, then with sequence parallelism.

    Returns:
        ``{"tp": ..., "sp": ...}`` (one launch for the page instead of two).
    """
    return {"tp": sp_block_run(cfg, batch, False, seed),
            "sp": sp_block_run(cfg, batch, True, seed)}


def train_interleaved(gpt: dict, batch: int, n_microbatches: int, steps: int,
                      n_chunks: int, schedule: str = "interleaved-1f1b"
                      ) -> dict[str, Any]:
    """One rank of Chapter 6's pipeline training with a multi-stage torch schedule.

    The GPT is cut into ``p * v`` stages (``v = n_chunks``); with an interleaved
    schedule rank ``r`` holds the virtual stages ``r, r + p, ..., r + (v - 1) p``,
    with a V-shaped one (``"zb-v"``, ``"dualpipev"``, ``v = 2``) stages ``r`` and
    ``2p - 1 - r``, each wrapped in a ``PipelineStage``; torch's schedule runs them
    inside the one loop (:func:`dtlib.pipeline_parallel.parallelism` with
    ``chunks``). The loss divides by ``m`` and ``scale_grads`` is off, as in
    Chapter 6's torch path.

    Args:
        gpt: the GPT's configuration as a dict (Chapter 6's ``PP_GPT``).
        batch, n_microbatches, steps: as Chapter 6's ``train_pipeline``.
        n_chunks: model chunks per rank, ``v``.
        schedule: a multi-stage name of
            :data:`~dtlib.pipeline_parallel.parallelism.TORCH_SCHEDULES`.
    Returns:
        ``losses``, every stage's ``grads`` (step 0) and ``params`` (after
        ``steps``), by the whole model's parameter names.
    """
    multi = sorted(s for s, row in TORCH_SCHEDULES.items() if row[1] != 1)
    if schedule not in multi:
        raise ValueError(f"schedule={schedule!r} is not allowed; allowed: {multi}")
    return train_pipeline(gpt, batch, n_microbatches, steps, f"torch-{schedule}",
                          chunks=n_chunks)
