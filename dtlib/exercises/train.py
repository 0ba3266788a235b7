"""Checkers for Chapter 10, "Capstone: one training script"."""

from __future__ import annotations

from typing import Any, Callable

from dtlib.exercises import (WrongAnswer, as_number, check_close, checker, passed,
                             run_on_ranks)
from dtlib.runtime.i18n import N_, _

_CASES = ((1, 4, 32, 1), (4, 2, 32, 1), (4, 2, 32, 4), (8, 1, 1024, 16))


def _truth(world_size: int, micro_batch: int, seq_len: int, accum_steps: int) -> float:
    # The summed token loss of one micro-batch times this factor, averaged over ranks
    # by DDP and summed over micro-batches, is the mean loss over the global batch.
    return world_size / (world_size * micro_batch * seq_len * accum_steps)


#: What ``check_loss_multiplier`` switches off while the learner's function runs.
_LOSS_MULTIPLIER_FORBIDS = {
    'dtlib.exercises.train:_truth': N_("the checker's truth"),
}


@checker(forbids=_LOSS_MULTIPLIER_FORBIDS)
def check_loss_multiplier(multiplier: Callable[[int, int, int, int], float]) -> None:
    """Check ``multiplier(world_size, micro_batch, seq_len, accum_steps)``: the factor
    that turns a micro-batch's *summed* token loss into its share of the global mean
    loss when DDP averages gradients over ranks (Chapter 10's loop, Chapter 8)."""
    for world_size, micro_batch, seq_len, accum_steps in _CASES:
        got = multiplier(world_size, micro_batch, seq_len, accum_steps)
        got = got if as_number(got) is None else as_number(got)
        truth = _truth(world_size, micro_batch, seq_len, accum_steps)
        if isinstance(got, (int, float)) and world_size > 1 \
                and abs(got - truth / world_size) <= 1e-12 * truth:
            raise WrongAnswer(
                _("world_size={world_size}: {got!r} is the mean over the global "
                  "batch's tokens, but DDP then divides the summed gradients by "
                  "world_size again. Hint: multiply by world_size to undo that "
                  "division.").format(world_size=world_size, got=got))
        check_close(_("multiplier(world_size={world_size}, micro_batch={micro_batch}, "
                      "seq_len={seq_len}, accum_steps={accum_steps})").format(
                        world_size=world_size, micro_batch=micro_batch,
                        seq_len=seq_len, accum_steps=accum_steps), got, truth,
                    rel=1e-9, hint=_("count the tokens of the whole optimizer step on "
                                     "all ranks, and remember what DDP does to the "
                                     "ranks' gradients (Chapter 8, 'Accumulation "
                                     "under DDP')"))
    passed(_("your multiplier is right for {n__cases} configurations").format(
               n__cases=len(_CASES)))


# ---- build it: wrap a GPT with FSDP2, block by block, on real ranks ------------------

_FSDP_MICRO = 2


def _fsdp_on_rank(wrap: Callable[[Any], Any]) -> dict[str, Any]:
    """On every rank: the learner's wrapping of the tiny GPT, one backward on this
    rank's rows of the global batch; which modules are FSDP units, and the gradients."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    # loads torch on first use: this module imports without it
    from dtlib.models.gpt import build_gpt, token_batch
    from dtlib.models.run import full_tensor, is_dtensor
    from dtlib.models.sizes import size

    cfg = size("tiny")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_gpt(cfg)
    try:
        wrapped = wrap(model)
    except Exception as exc:  # e.g. torch's error for a block wrapped after the root
        return {"error": f"{type(exc).__name__}: {exc}",
                "root": isinstance(model, FSDPModule),
                "blocks": [isinstance(b, FSDPModule) for b in model.blocks]}
    if wrapped is None:
        wrapped = model
    idx, targets = token_batch(cfg, world_size * _FSDP_MICRO, seed=0)
    rows = slice(rank * _FSDP_MICRO, (rank + 1) * _FSDP_MICRO)
    loss = wrapped(idx[rows], targets[rows])[1]
    # Between forward and backward a resharded unit's parameters are its shards
    # (DTensors) again; a unit that keeps them gathered holds plain full tensors.
    resharded = [all(is_dtensor(p) for p in b.parameters()) for b in model.blocks]
    loss.backward()
    grads = {n: full_tensor(p.grad) for n, p in model.named_parameters()
             if p.grad is not None}
    return {"root": isinstance(model, FSDPModule),
            "blocks": [isinstance(b, FSDPModule) for b in model.blocks],
            "resharded": resharded, "grads": grads}


def _grad_tol(want: Any) -> float:
    """How far a right gradient may be from one process's: only the order of float32
    sums differs (each entry sums the global batch's 4 x 16 = 64 tokens, over
    activations from dot products of up to 4 x hidden = 128 terms). Reordering an
    n-term sum moves it by at most (n - 1) u times the magnitudes summed, of the
    order of the tensor's largest entry: 128 u max|want| (u = 2**-24; measured:
    ~6 u). A gradient off by a missing 1/N is off by half of itself."""
    return 128 * 2.0 ** -24 * float(want.abs().max())


#: What ``check_fsdp2_wrapping`` switches off while the learner's function runs.
_FSDP2_WRAPPING_FORBIDS = {
    'dtlib.zero.fsdp:shard_fsdp2': N_("the book's own FSDP2 wrapping"),
}


@checker(forbids=_FSDP2_WRAPPING_FORBIDS)
def check_fsdp2_wrapping(wrap: Callable[[Any], Any], world_size: int = 2) -> None:
    """Check ``wrap(model)``: shard the book's GPT with FSDP2 (``fully_shard``), one
    unit per transformer block and the root last, so that one block's parameters are
    gathered at a time. Runs on ``world_size`` real ranks; the gradients after one
    backward must equal one process's on the whole batch."""
    # loads torch on first use: this module imports without it
    from dtlib.models.reference import reference_gpt_run
    from dtlib.models.sizes import size

    ranks = run_on_ranks(_fsdp_on_rank, wrap, world_size, what=_(
            "your FSDP2 wrapping"))
    res = ranks[0]
    if "error" in res:
        if res["root"] and not all(res["blocks"]):
            raise WrongAnswer(
                _("the root was sharded before its blocks: fully_shard(model) makes "
                  "every parameter of the model, the blocks' included, part of the "
                  "root's unit, and a block wrapped afterwards finds its parameters "
                  "already sharded (torch says: {res_error}).").format(
                    res_error=res['error'][:120]), _(
                            "wrap innermost first: each block, then the root (Chapter "
                            "4, 'FSDP2')"))
        raise WrongAnswer(_("your wrap raised {res_error}").format(
                              res_error=res['error']))
    if not res["root"]:
        raise WrongAnswer(
            _("the model itself is not sharded: its own parameters (embeddings, final "
              "norm, head) stay whole on every rank, and nothing gathers the first "
              "unit before forward."), _("call fully_shard on the root too, after the "
                                         "blocks (Chapter 4, 'FSDP2')"))
    if not all(res["blocks"]):
        missing = [i for i, unit in enumerate(res["blocks"]) if not unit]
        raise WrongAnswer(
            _("blocks {missing} are not units of their own: their parameters belong "
              "to the root's unit, which is gathered whole, so the peak memory holds "
              "the whole model.").format(missing=missing), _(
                      "fully_shard each block first (innermost units first), then the "
                      "root"))
    kept = [i for i, r in enumerate(res["resharded"]) if not r]
    if kept:
        raise WrongAnswer(
            _("blocks {kept} keep their gathered parameters after forward "
              "(reshard_after_forward=False): every block's full parameters then stay "
              "in memory until its backward, and the peak is the whole model "
              "again.").format(kept=kept),
            _("leave reshard_after_forward at its default, True, for the blocks: each "
              "is gathered again in backward (Chapter 4, 'FSDP2')"))
    truth = reference_gpt_run(size("tiny"), world_size * _FSDP_MICRO, 1)["grads"]
    for name, want in truth.items():
        got = res["grads"].get(name)
        if got is None or (got - want).abs().max() > _grad_tol(want):
            raise WrongAnswer(_("the gradient of {name} differs from one process's on "
                                "the whole batch.").format(name=name))
    passed(_("each of {n_res_blocks} blocks is an FSDP2 unit, then the root; the "
             "gradients on {world_size} ranks equal one process's").format(
               n_res_blocks=len(res['blocks']), world_size=world_size))
