"""What Chapter 7's "Mixed precision across ranks" runs on real ranks.

- :func:`policy_rank`: the book's ZeRO-3 (:class:`~dtlib.zero.FullyShardedModule`)
  and torch's FSDP2 under the same ``MixedPrecisionPolicy``: losses, the first
  step's averaged gradients, the parameters after the last step and the bytes of
  each collective of one step. :func:`simulated` is the one process with the same
  casts (:class:`~dtlib.precision.sharded.SimulatedRanks`).
- :func:`scaler_rank`: ZeRO-3 with a loss scaler, an inf or NaN planted in one rank's
  gradient shard at one step; the per-rank scaler (each rank decides alone) against
  :class:`~dtlib.precision.sharded.ShardedLossScaler` (one all-reduce of the flag).

Taught in: Chapter 7, "Mixed precision across ranks".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtlib.collectives.accounting import CountComms
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.run import (OnStepEnd, Parallelism, RunConfig, StepEnd, TrainState,
                              default_step, run_steps)
from dtlib.precision.loss_scaling import DynamicLossScaler
from dtlib.precision.sharded import ShardedLossScaler, SimulatedRanks
from dtlib.runtime.dist import world
from dtlib.zero import MixedPrecisionPolicy, parallelism

__all__ = ["POLICIES", "PAGE_POLICIES", "GPT", "policy", "policy_rank", "simulated",
           "scaler_rank", "wire_bytes", "page_rank", "policy_table",
           "UNIT_ROUNDOFF", "policy_tolerances", "compare_variants"]

#: The small GPT of these runs (Chapter 4's test GPT: every size divides 4).
GPT = dict(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=2)
#: (param_dtype, reduce_dtype) by name; "fp32" is Chapter 4's policy-free run.
POLICIES = {"fp32": (None, None),
            "bf16": (torch.bfloat16, torch.float32),
            "bf16-reduce-bf16": (torch.bfloat16, torch.bfloat16),
            "fp16": (torch.float16, torch.float32)}
SGD = dict(lr=0.05, momentum=0.9)
ROWS_PER_RANK = 2


def policy(name: str) -> MixedPrecisionPolicy | None:
    """The ``MixedPrecisionPolicy`` of :data:`POLICIES` ``[name]`` (None: fp32)."""
    if name not in POLICIES:
        raise ValueError(f"name={name!r} not allowed; allowed: {tuple(POLICIES)}")
    param_dtype, reduce_dtype = POLICIES[name]
    if param_dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _loss(net: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = net(x)  # in param_dtype; the cross-entropy in fp32, as autocast does
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def _batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = GPTConfig(**GPT)
    x, y = token_batch(cfg, ROWS_PER_RANK * world_size, seed=1)
    return x.to(world().device), y.to(world().device)


def wire_bytes(log: Any) -> dict[str, dict[str, int]]:
    """Bytes per collective of a :func:`count_comms` log, payload apart from the
    bookkeeping: ``{op: {"payload": bytes, "payload_numel": elements, "other":
    bytes}}``. Payload: the floating-point messages (2 or 4 bytes an element); the
    integer checks (8 bytes) and flags (4 bytes in an all-reduce) are "other"."""
    out: dict[str, dict[str, int]] = {}
    for r in log.records:
        row = out.setdefault(r.op, {"payload": 0, "payload_numel": 0, "other": 0})
        size = r.bytes // max(r.numel, 1)
        if r.op in ("all_gather", "reduce_scatter") and size in (2, 4):
            row["payload"] += r.bytes
            row["payload_numel"] += r.numel
        else:
            row["other"] += r.bytes
    return out


def policy_rank(names: tuple[str, ...] = tuple(POLICIES), steps: int = 3
                ) -> dict[str, Any]:
    """On every rank: both variants under each policy in ``names``, ``steps`` steps
    of SGD with momentum on the same batch.

    Returns:
        ``{(variant, name): {"losses", "grads" (first step, full), "params" (after
        the last step), "bytes" (:func:`wire_bytes` of step 1), "n_params"}}``,
        variant ``"ours"`` or ``"fsdp2"``.
    """
    x, y = _batch(dist.get_world_size())
    out: dict[Any, Any] = {}
    for name in names:
        for variant in ("ours", "fsdp2"):
            net = build_gpt(GPTConfig(**GPT), 0).to(world().device)
            n_params = sum(p.numel() for p in net.parameters())
            par = parallelism(3, variant=variant, mp_policy=policy(name))
            config = RunConfig(steps, optimizer_class=torch.optim.SGD,
                               optimizer_kwargs=SGD, loss_fn=_loss)
            run = run_steps(par, net, lambda step: (x, y), config,
                            callbacks=[CountComms(2)])  # the second step
            out[variant, name] = {"losses": run.losses, "grads": run.grads,
                                  "params": run.params, "n_params": n_params,
                                  "bytes": wire_bytes(run.comms)}
    return out


def simulated(world_size: int, name: str, steps: int = 3) -> dict[str, Any]:
    """One process with the casts of ``world_size`` ranks under policy ``name``
    (:class:`SimulatedRanks`; fp32: plain one process on the global batch)."""
    param_dtype, reduce_dtype = POLICIES[name]
    par = Parallelism() if param_dtype is None else SimulatedRanks(
        world_size, param_dtype, reduce_dtype)
    x, y = _batch(world_size)
    run = run_steps(par, build_gpt(GPTConfig(**GPT), 0), lambda step: (x, y),
                    RunConfig(steps, optimizer_class=torch.optim.SGD,
                              optimizer_kwargs=SGD, loss_fn=_loss))
    return {"losses": run.losses, "grads": run.grads, "params": run.params}


def scaler_rank(agree: bool, bad: str = "inf", bad_rank: int = 1, bad_step: int = 1,
                steps: int = 4, growth_interval: int = 1,
                world_size: int | None = None) -> dict[str, Any]:
    """On every rank: ZeRO-3 trained with a loss scaler; at step ``bad_step`` rank
    ``bad_rank`` finds ``bad`` (``"inf"`` or ``"nan"``) in its gradient shard.

    The value is planted after backward in the first element of that rank's first
    gradient piece: what an overflow in an element of that rank's shard looks like
    after the reduce-scatter (the other ranks' shards are finite).

    Args:
        agree: True: :class:`ShardedLossScaler` (the flag all-reduced); False:
            :class:`DynamicLossScaler` on each rank alone.
        growth_interval: clean steps before the scale doubles (1: every clean step,
            so the scales part at once when the ranks disagree).
        world_size: the ranks whose global batch to train on (default: this
            world's); one process with ``world_size=N`` and ``bad_rank=0`` is the
            reference that skips the bad step.
    Returns:
        ``{"scales": S after each step, "params": full parameters after the
        last step}``.
    """
    if bad not in ("inf", "nan"):
        raise ValueError(f"bad={bad!r} not allowed; allowed: 'inf', 'nan'")
    x, y = _batch(world_size or world().world_size)
    kwargs = dict(init_scale=2.0 ** 10, growth_interval=growth_interval)
    scaler = ShardedLossScaler(**kwargs) if agree else DynamicLossScaler(**kwargs)
    out: dict[str, Any] = {"scales": []}
    step_no = [0]

    def step_fn(par: Any, wrapped: Any, batch: Any, loss_fn: Any,
                scaler: Any = None) -> torch.Tensor:
        loss = default_step(par, wrapped, batch, loss_fn, scaler=scaler)
        if step_no[0] == bad_step and world().rank == bad_rank:
            next(wrapped.parameters()).grad.view(-1)[0] = float(bad)
        step_no[0] += 1
        return loss

    def scale_after(end: StepEnd) -> None:
        out["scales"].append(scaler.get_scale())

    net = build_gpt(GPTConfig(**GPT), 0).to(world().device)
    config = RunConfig(steps, optimizer_class=torch.optim.SGD, optimizer_kwargs=SGD,
                       loss_fn=_loss, step_fn=step_fn, record_grads=False)
    run = run_steps(parallelism(3), net, lambda step: (x, y), config,
                    TrainState(scaler=scaler), [OnStepEnd(scale_after)])
    out["params"] = run.params
    return out


#: The policies the page runs (fp16's differ from bf16's only in the format).
PAGE_POLICIES = ("fp32", "bf16", "bf16-reduce-bf16")


def page_rank() -> dict[str, Any]:
    """On every rank: what the page shows, in one launch: :data:`PAGE_POLICIES` with
    both variants, and the inf on rank 1's shard with and without the agreement."""
    out: dict[Any, Any] = policy_rank(PAGE_POLICIES)
    for agree in (False, True):
        out["scaler", agree] = scaler_rank(agree)
    return out


def policy_table(ranks: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The page's table: per policy, rank 0's bytes per step and the largest
    first-step gradient difference, relative to the largest gradient, from FSDP2's
    and from one process's with the same casts (:func:`simulated`)."""
    rows = []
    for name in PAGE_POLICIES:
        ours, fsdp2 = ranks[0]["ours", name], ranks[0]["fsdp2", name]
        sim = simulated(world_size, name)
        scale = max(float(g.abs().max()) for g in fsdp2["grads"].values())

        def diff(want: dict[str, torch.Tensor]) -> float:
            return max(float((ours["grads"][n] - w).abs().max())
                       for n, w in want.items()) / scale

        param_dtype, reduce_dtype = POLICIES[name]
        rows.append({
            "policy": name,
            "param_dtype": str(param_dtype or torch.float32).removeprefix("torch."),
            "reduce_dtype": str(reduce_dtype or param_dtype or torch.float32)
            .removeprefix("torch."),
            "all-gather bytes": ours["bytes"]["all_gather"]["payload"],
            "reduce-scatter bytes": ours["bytes"]["reduce_scatter"]["payload"],
            "vs FSDP2": diff(fsdp2["grads"]), "vs one process": diff(sim["grads"])})
    return rows


#: Unit roundoff (half an ulp of 1.0) of the dtypes a policy names.
UNIT_ROUNDOFF = {None: 2.0 ** -24, torch.float32: 2.0 ** -24,
                 torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def policy_tolerances(world_size: int, name: str, same_kernels: bool = False
                      ) -> tuple[float, float, float]:
    """``(rel_grad, rel_param, rel_loss)``: how far two implementations of policy
    ``name`` may differ: gradients and parameters relative to the largest first-step
    gradient, losses relative to the loss.

    Every implementation casts the same fp32 master values to ``param_dtype`` and
    runs each rank's rows through the same ops. What may differ:

    - the N-term sum of the reduction in ``reduce_dtype`` (its order, where the 1/N
      goes): at most (N - 1) u sum_r |g_r| plus a rounding (Higham, 4.2), and a
      rank's gradient (the mean over its share of the rows) is taken to be at most N
      times the global mean's scale: ``2 N**2 u_reduce``;
    - unless ``same_kernels`` (the same process, buffers and inputs), the 16-bit
      compute itself: a matmul accumulates in fp32 in a kernel-dependent order, and
      its 16-bit output may then round to the neighbouring value, one ulp (2 u_param
      relative). Such a flip can happen at each of the ~``4 n_layers + 2`` products
      on a gradient's path (four per block, the embedding and the head), each O(1)
      gain: ``2 (4 n_layers + 2) u_param`` more, for gradients and for the loss;
    - parameters after 3 SGD steps (lr 0.05, momentum 0.9) move by at most
      lr * (1 + 1.9 + 2.71) = 0.28 times a gradient difference, and a later step's
      16-bit cast of master values that now differ may round the other way, one
      ulp of a weight changing the gradient by at most ``u_param`` relative:
      ``rel_param = 0.28 (rel_grad + u_param)``;
    - the loss: a mean of T = 2N x 16 positive token losses summed in another order,
      T u32 relative, plus the compute term.
    """
    param_dtype, reduce_dtype = POLICIES[name]
    u_param = UNIT_ROUNDOFF[param_dtype]
    compute = 0.0 if same_kernels else 2 * (4 * GPT["n_layers"] + 2) * u_param
    rel_grad = 2 * world_size ** 2 * UNIT_ROUNDOFF[reduce_dtype or param_dtype] \
        + compute
    gain = SGD["lr"] * sum((1 - SGD["momentum"] ** (3 - k)) / (1 - SGD["momentum"])
                           for k in range(3))
    tokens = ROWS_PER_RANK * world_size * GPT["seq_len"]
    return (rel_grad, gain * (rel_grad + u_param),
            tokens * UNIT_ROUNDOFF[None] + compute)


def compare_variants(name: str = "bf16") -> dict[str, Any]:
    """On every rank: both variants under policy ``name``; how far ours is from
    FSDP2, relative to the largest gradient, and ours' payload bytes.

    Returns:
        ``{"grad", "param"}`` (relative differences), ``"rel_grad"``,
        ``"rel_param"`` (:func:`policy_tolerances`), ``"all_gather"``,
        ``"reduce_scatter"`` (payload bytes of one step), ``"n_params"``.
    """
    runs = policy_rank((name,))
    ours, fsdp2 = runs["ours", name], runs["fsdp2", name]
    scale = max(float(g.abs().max()) for g in fsdp2["grads"].values())

    def diff(key: str) -> float:
        return max(float((ours[key][n].cpu() - w.cpu()).abs().max())
                   for n, w in fsdp2[key].items()) / scale

    # FSDP2's buffers are not ours: a GPU kernel may be chosen by alignment
    rel_grad, rel_param, _ = policy_tolerances(world().world_size, name)
    return {"grad": diff("grads"), "param": diff("params"), "rel_grad": rel_grad,
            "rel_param": rel_param, "n_params": ours["n_params"],
            "all_gather": ours["bytes"]["all_gather"]["payload"],
            "reduce_scatter": ours["bytes"]["reduce_scatter"]["payload"]}
