"""Checkers for Chapter 1, "Memory math"."""

from __future__ import annotations

from typing import Any, Callable

from dtlib.exercises import (WrongAnswer, as_number, check_close, checker, passed,
                             run_on_ranks)
from dtlib.memory.formulas import GB, TrainingConfig, estimate, model_state_bytes
from dtlib.runtime.i18n import N_, _

# The model of the third exercise: a 13B-class GPT trained on 64 data-parallel GPUs.
FIT_MODEL = dict(n_layers=40, hidden=5120, n_heads=40, vocab_size=50257,
                 seq_len=2048, micro_batch=1, dp=64)
STAGES = (0, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")
# The largest share of the device that "Make it fit" lets a learner set aside with
# ``fits(device_gb, reserved_gb=...)`` (CUDA context, NCCL buffers, fragmentation).
RESERVED_MAX_FRACTION = 0.1


_BYTES_HINT = N_("list every copy a parameter has during a mixed-precision Adam step "
               "(weights, gradient, what the optimizer keeps) with its dtype; "
               "'The corrected accounting' names them")


@checker
def check_bytes_per_param(answer: float) -> None:
    """Bytes per parameter of mixed-precision Adam (params + grads + optimizer)."""
    hints = {10: _("that is the seed's mistake: every copy in the 16-bit dtype. The "
                   "optimizer keeps an fp32 master copy and both moments in fp32."),
             12: _("12 is K, the optimizer state alone (master copy and moments). "
                   "What else does each parameter keep in memory while it trains?"),
             14: _("one 16-bit copy is missing: what does backward() write for each "
                   "parameter?"),
             8: _("8 bytes are Adam's two fp32 moments; the optimizer keeps more, and "
                  "so does the model itself.")}
    if as_number(answer) is not None and as_number(answer) in hints:
        raise WrongAnswer(_("bytes per parameter: got {answer!r}; ").format(
            answer=answer) + hints[answer], _(_BYTES_HINT))
    check_close(_("bytes per parameter"), answer, 16.0, hint=_(_BYTES_HINT))
    passed(_("mixed-precision Adam holds 2 + 2 + 12 = 16 bytes per parameter"))


#: The exercise's model and data-parallel degree (Chapter 1, "ZeRO-2 by hand").
ZERO2_PSI, ZERO2_DP = 7.5e9, 64


@checker
def check_zero2_gb(n_params: float, dp: int, answer_gb: float) -> None:
    """Per-device model-state memory in GB (1e9 B) under ZeRO-2 (P_os+g), for the
    exercise's Psi and N_d: an answer for other numbers the learner passed in (say
    N_d = 1, where every stage holds everything) is refused."""
    if (as_number(n_params), as_number(dp)) != (ZERO2_PSI, ZERO2_DP):
        raise WrongAnswer(
            _("you passed Psi={n_params!r}, N_d={dp!r}: the exercise's model is "
              "Psi = {psi:.3g} parameters on N_d = {n_d} GPUs; keep them "
              "and compute the answer for those").format(
                  n_params=n_params, dp=dp, psi=ZERO2_PSI, n_d=ZERO2_DP))
    truth = {s: model_state_bytes(n_params, zero_stage=s, dp=dp).total / GB
             for s in STAGES}
    for s, name in ((0, _("plain data parallelism")), (1, "ZeRO-1"), (3, "ZeRO-3")):
        if as_number(answer_gb) is not None \
                and abs(as_number(answer_gb) - truth[s]) <= 1e-3 * truth[s] \
                and abs(truth[s] - truth[2]) > 1e-3 * truth[2]:
            raise WrongAnswer(
                _("ZeRO-2 memory: {answer_gb!r} GB is the {name} figure. ZeRO-2 "
                  "partitions the optimizer state and the gradients, not the "
                  "params.").format(answer_gb=answer_gb, name=name))
    check_close(_("ZeRO-2 memory (GB)"), answer_gb, truth[2], rel=1e-3,
                hint=_("which of the three model states does ZeRO-2 split over the "
                       "N_d ranks, and which stays whole on every rank? ('ZeRO: "
                       "sharding the model states'; GB = 1e9 bytes)"))
    passed(_("ZeRO-2 holds {gb:.2f} GB per device for Psi={n_params:.3g}, "
             "N_d={dp}").format(gb=truth[2], n_params=n_params, dp=dp))


def fitting_combinations(device_gb: float = 80.0,
                         reserved_gb: float = 0.0) -> set[tuple[int, str]]:
    """Every (zero_stage, recompute) for which ``FIT_MODEL`` fits ``device_gb`` with
    ``reserved_gb`` set aside.

    Args:
        device_gb: device memory in GB (1e9 bytes).
        reserved_gb: GB kept free for what the estimate does not model.
    Returns:
        The set of fitting ``(zero_stage, recompute)`` pairs.

    Taught in: Chapter 1, the planner.
    """
    return {(s, r) for s in STAGES for r in RECOMPUTES
            if estimate(TrainingConfig(**FIT_MODEL, zero_stage=s, recompute=r))
            .fits(device_gb, reserved_gb=reserved_gb)}


def _fit_total_gb(pair: tuple[int, str]) -> float:
    return estimate(TrainingConfig(**FIT_MODEL, zero_stage=pair[0],
                                   recompute=pair[1])).total / GB


@checker
def check_fitting_combinations(answer, device_gb: float = 80.0) -> None:
    """``answer``: the set of (zero_stage, recompute) pairs that fit on the device.

    Any margin from 0 up to :data:`RESERVED_MAX_FRACTION` of the device, set aside
    with ``fits(device_gb, reserved_gb=...)``, gives a right answer: the set of the
    pairs whose estimate plus the margin fits.
    """
    try:
        got = {(int(s), str(r)) for s, r in answer}
    except (TypeError, ValueError):
        raise WrongAnswer(_("expected a set of (zero_stage, recompute) pairs such "
                            "as {example}, got {answer!r}").format(
                                example="{(3, 'full')}", answer=answer)) from None
    bad = [p for p in got if p[0] not in STAGES or p[1] not in RECOMPUTES]
    if bad:
        raise WrongAnswer(_("unknown pairs {bad}: stages are {stages}, recompute is "
                            "one of {recomputes}").format(
                                bad=sorted(bad), stages=STAGES, recomputes=RECOMPUTES))
    most = fitting_combinations(device_gb)  # no margin: the largest right set
    fewest = fitting_combinations(device_gb, RESERVED_MAX_FRACTION * device_gb)

    def gb(pair):
        e = estimate(TrainingConfig(**FIT_MODEL, zero_stage=pair[0], recompute=pair[1]))
        return _("{pair}: {states:.1f} GB states + {acts:.1f} GB activations").format(
            pair=pair, states=e.model_states / GB, acts=e.activations / GB)

    extra = sorted(got - most)
    if extra:
        raise WrongAnswer(_("these do not fit on {device_gb:g} GB: ").format(
            device_gb=device_gb) + "; ".join(gb(p) for p in extra))
    missing = sorted(fewest - got)
    if missing:
        raise WrongAnswer(_("you left out {n} pair(s) that fit even with {pct:g} % "
                            "of the device set aside, e.g. {example}. Hint: check "
                            "every stage with every recompute choice.").format(
                                n=len(missing), pct=100 * RESERVED_MAX_FRACTION,
                                example=gb(missing[0])))
    # A margin keeps out the pairs above some total: each pair left out must need
    # more than each pair kept.
    if got and (most - got):
        kept, left = max(map(_fit_total_gb, got)), min(map(_fit_total_gb, most - got))
        if left <= kept:
            raise WrongAnswer(
                _("no single reserved margin gives this set: you left out a pair that "
                  "needs less memory than one you kept."),
                _("a margin set aside with fits(device_gb, reserved_gb=...) removes "
                  "the pairs with the largest totals first"))
    if got == most:
        passed(_("{n} of the 12 combinations fit on {device_gb:g} GB").format(
            n=len(got), device_gb=device_gb))
    else:
        passed(_("{n} of the 12 combinations fit on {device_gb:g} GB with a reserved "
                 "margin").format(n=len(got), device_gb=device_gb))


# ---- build it: a layer's saved activations, counted on ranks -----------------------

# (seq_len, hidden, n_heads, micro-batch on rank 0, on rank 1): shapes the chapter
# does not show, and ranks with different batches so that one rank's count is not
# the total.
SAVED_CASES = ((16, 32, 2, 1, 3), (8, 48, 4, 2, 1))


_NO_COLLECTIVE = "no collective: "


def _number_or_repr(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def saved_on_rank(count: Callable[..., Any]) -> list[Any]:
    """On each rank: the learner's count for a fresh ``Block`` of each case.

    Args:
        count: the learner's ``count(layer, x)``.
    Returns:
        What it returned for each of :data:`SAVED_CASES` (its repr if not a number).

    Taught in: Chapter 1, exercise "A layer's saved activations".
    """
    import torch
    import torch.distributed as dist

    # loads torch on first use: this module imports without it
    from dtlib.collectives.accounting import count_comms
    from dtlib.models.gpt import Block, GPTConfig
    from dtlib.runtime.dist import world

    rank, device, out = dist.get_rank(), world().device, []
    for s, h, a, *batches in SAVED_CASES:
        torch.manual_seed(0)
        layer = Block(GPTConfig(seq_len=s, hidden=h, n_heads=a)).to(device).train()
        x = torch.randn(batches[rank], s, h, device=device, requires_grad=True)
        with count_comms() as log:
            got = count(layer, x)
        got = as_number(got) if as_number(got) is not None else repr(got)
        # the ranks' micro-batches differ: their sum cannot be known without a
        # collective (a table of the checker's cases could give it)
        out.append(got if log.records else f"{_NO_COLLECTIVE}{got}")
    return out


def saved_bytes_truth(seq_len: int, hidden: int, n_heads: int,
                      batches: tuple[int, ...]) -> int:
    """Bytes one ``dtlib.models`` block (fp32, no dropout, explicit attention) saves
    for backward, summed over ranks holding ``batches`` sequences each.

    Args:
        seq_len, hidden, n_heads: the block's shape.
        batches: micro-batch of each rank.
    Returns:
        The sum over ranks of :func:`dtlib.memory.gpt_layer_activation_terms`.

    Taught in: Chapter 1, measured: activations.
    """
    # loads torch on first use: this module imports without it
    from dtlib.memory.measure import gpt_layer_activation_terms

    return sum(sum(gpt_layer_activation_terms(seq_len, b, hidden, n_heads,
                                              dtype_bytes=4, dropout=False,
                                              mask_bytes=4).values())
               for b in batches)


#: What ``check_saved_bytes`` switches off while the learner's function runs.
_SAVED_BYTES_FORBIDS = {
    'dtlib.exercises.memory:saved_bytes_truth': N_("the checker's truth"),
    'dtlib.memory.formulas:activation_bytes':
        N_("the book's per-layer formula, the checker's truth"),
    'dtlib.memory.measure:measure_activations': N_("the book's own counter"),
    'dtlib.memory.measure:measure_gpt_layer': N_("the book's own counter"),
    'dtlib.memory.measure:gpt_layer_activation_terms': N_("the book's own counter"),
}


@checker(forbids=_SAVED_BYTES_FORBIDS)
def check_saved_bytes(count: Callable[..., Any]) -> None:
    """Check ``count(layer, x)``, run on 2 real ranks: the bytes autograd saves for
    backward in ``layer(x)`` (each storage once, parameters left out), summed over
    the ranks, the same on every rank.

    The truth is Chapter 1's per-layer formula for this block in fp32
    (:func:`saved_bytes_truth`), for shapes and per-rank batches the chapter does
    not show.
    """
    judge_saved_bytes(run_on_ranks(saved_on_rank, count, 2,
                                   what=_("your saved-bytes count")))


def judge_saved_bytes(ranks: list[list[Any]]) -> None:
    """Raise :class:`WrongAnswer` unless each rank's results of :func:`saved_on_rank`
    equal the formula summed over the ranks; say so if they do.

    Args:
        ranks: what :func:`saved_on_rank` returned on rank 0 and rank 1.
    Returns:
        None.

    Taught in: Chapter 1, exercise "A layer's saved activations".
    """
    for i, (s, h, a, *batches) in enumerate(SAVED_CASES):
        got = [r[i] for r in ranks]
        where = _("a block with s={s}, h={h}, a={a}, micro-batch {b0} on rank 0 and "
                  "{b1} on rank 1").format(s=s, h=h, a=a, b0=batches[0], b1=batches[1])
        silent = [isinstance(g, str) and g.startswith(_NO_COLLECTIVE) for g in got]
        got = [_number_or_repr(g[len(_NO_COLLECTIVE):]) if quiet else g
               for g, quiet in zip(got, silent)]
        if any(isinstance(g, str) for g in got):
            raise WrongAnswer(_("{where}: return a number of bytes, got {got}").format(
                where=where, got=got))
        truth = saved_bytes_truth(s, h, a, tuple(batches))
        mine = [saved_bytes_truth(s, h, a, (b,)) for b in batches]
        if got[0] != got[1]:
            raise WrongAnswer(
                _("{where}: rank 0 returned {got0:g}, rank 1 {got1:g}.").format(
                    where=where, got0=got[0], got1=got[1]),
                _("each rank counts its own tensors; every rank must return the sum "
                  "over all ranks (dist.all_reduce of a tensor holding the count)"))
        if got[0] == mine[0] or got[0] == mine[1]:
            raise WrongAnswer(_("{where}: {got:g} bytes is one rank's own count, "
                                "not the sum over the ranks.").format(
                                    where=where, got=got[0]))
        if got[0] != truth:
            side = _("too many") if got[0] > truth else _("too few")
            raise WrongAnswer(
                _("{where}: {got:g} bytes summed over the ranks, {side}.").format(
                    where=where, got=got[0], side=side),
                _("count bytes (untyped_storage().nbytes()), each storage once (the "
                  "softmax output is saved by two ops; a view shares its base's "
                  "storage), and leave out the parameters a linear layer saves"))
        if any(silent):
            raise WrongAnswer(
                _("{where}: the right sum, but rank {rank} found it without any "
                  "collective: each rank holds only its own micro-batch, so only "
                  "communication can tell it the others' counts.").format(
                      where=where, rank=silent.index(True)),
                _("all-reduce a tensor holding this rank's count"))
    passed(_("your count equals the per-layer formula, summed over both ranks, for "
             "{n} shapes").format(n=len(SAVED_CASES)))
