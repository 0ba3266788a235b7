"""Checkers for Chapter 7, "Mixed precision"."""

from __future__ import annotations

import random
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from dtlib.collectives.accounting import count_comms
from dtlib.exercises import WrongAnswer, check_close, checker, passed, run_on_ranks
from dtlib.runtime.dist import world
from dtlib.runtime.i18n import N_, _

# Formats the chapter does not tabulate (exponent bits, mantissa bits), IEEE-style:
# the all-ones exponent is kept for inf and NaN. fp16 and fp64 are there too, so that
# an answer is also checked against torch.finfo.
#: The gradient values of Chapter 7's underflow exercise.
UNDERFLOW_VALUES = (3e-5, 5e-8, 2e-8, 1e-20, 1e-45)
FORMATS_TRIED = ((5, 10), (6, 9), (4, 3), (3, 4), (11, 52), (7, 16))


def ieee_constants(e_bits: int, m_bits: int) -> tuple[float, float, float]:
    """(eps, smallest subnormal, largest finite) of an IEEE-style binary format.

    Args:
        e_bits: exponent bits (>= 2).
        m_bits: stored mantissa bits (>= 1).
    Returns:
        ``(2**-m, 2**(1 - bias - m), (2 - 2**-m) * 2**bias)`` with
        ``bias = 2**(e - 1) - 1``: the largest exponent field, all ones, is inf/NaN.

    Taught in: Chapter 7, "Floating-point formats".
    """
    if isinstance(e_bits, bool) or not isinstance(e_bits, int) or e_bits < 2:
        raise ValueError(f"e_bits={e_bits!r} must be an integer >= 2")
    if isinstance(m_bits, bool) or not isinstance(m_bits, int) or m_bits < 1:
        raise ValueError(f"m_bits={m_bits!r} must be an integer >= 1")
    bias = 2 ** (e_bits - 1) - 1
    return (2.0 ** -m_bits, 2.0 ** (1 - bias - m_bits),
            (2.0 - 2.0 ** -m_bits) * 2.0 ** bias)


#: What ``check_format_constants`` switches off while the learner's function runs.
_FORMAT_CONSTANTS_FORBIDS = {
    'dtlib.exercises.precision:ieee_constants': N_("the checker's truth"),
    'dtlib.precision.formats:format_info': N_("the book's own table"),
    'dtlib.precision.formats:format_table': N_("the book's own table"),
    'dtlib.precision.formats:subnormal_from_bits': N_("the book's own table"),
}


@checker(forbids=_FORMAT_CONSTANTS_FORBIDS)
def check_format_constants(constants: Callable[[int, int], tuple],
                           seed: int | None = None) -> None:
    """Check ``constants(e_bits, m_bits) -> (eps, smallest_subnormal, largest)`` on
    IEEE-style formats the chapter does not show (:data:`FORMATS_TRIED`) and three
    drawn from ``seed`` (2 to 11 exponent bits, 1 to 52 mantissa bits: every one
    whose constants float64 holds exactly).

    The truth is :func:`ieee_constants`, itself checked against ``torch.finfo`` and
    the bit patterns by the tests.
    """
    names = ("eps", _("smallest subnormal"), _("largest finite value"))
    hints = (_("eps is the gap between 1.0 and the next number: the value of the last "
               "stored mantissa bit at exponent 0"),
             _("a subnormal has the smallest exponent a normal has, no implicit 1, and "
               "only its last mantissa bit set"),
             _("the largest exponent field (all ones) is kept for inf and NaN; the "
               "largest finite value has the next exponent and every mantissa bit "
               "set"))
    rng = random.Random(seed)
    tried = (*FORMATS_TRIED, *((rng.randint(2, 11), rng.randint(1, 52))
                               for _ in range(3)))
    for e_bits, m_bits in tried:
        try:
            got = tuple(constants(e_bits, m_bits))
        except NotImplementedError:
            raise
        except Exception as err:  # the learner's code failed on a format
            raise WrongAnswer(_("constants({e_bits}, {m_bits}) raised "
                                "{type}: {err}").format(
                                  e_bits=e_bits, m_bits=m_bits,
                                  type=type(err).__name__, err=err)) from None
        if len(got) != 3:
            raise WrongAnswer(_("constants({e_bits}, {m_bits}) returned {n_got} "
                                "values; return (eps, smallest_subnormal, "
                                "largest)").format(
                                  e_bits=e_bits, m_bits=m_bits, n_got=len(got)))
        truth = ieee_constants(e_bits, m_bits)
        for name, g, t, hint in zip(names, got, truth, hints):
            # Powers of two and (2 - 2**-m) * 2**bias are exact in float64: an
            # exact answer is expected, up to one rounding of the product.
            check_close(_("{name} of {e_bits} exponent and {m_bits} mantissa "
                          "bits").format(name=name, e_bits=e_bits, m_bits=m_bits),
                        g, t, rel=2.0 ** -52, hint=hint)
    passed(_("eps, smallest subnormal and largest value right for {n_tried} formats, "
             "fp16 and fp64 among them").format(n_tried=len(tried)))


@checker
def check_underflow_prediction(values: list[float], fp16_zero: list[bool],
                               bf16_zero: list[bool]) -> None:
    """Check which of ``values`` become exactly 0 when stored in fp16 and in bf16.

    The truth is what torch does when it casts each value. ``values`` must hold the
    page's (:data:`UNDERFLOW_VALUES`): a shortened or empty list predicts nothing.
    """
    missing = [v for v in UNDERFLOW_VALUES if v not in list(values)]
    if missing:
        raise WrongAnswer(_("values lacks {missing}: predict for every value of the "
                            "exercise, {underflow_values}").format(
                              missing=missing,
                              underflow_values=list(UNDERFLOW_VALUES)))
    for dtype, guess in ((torch.float16, fp16_zero), (torch.bfloat16, bf16_zero)):
        if len(guess) != len(values):
            raise WrongAnswer(_("give one bool per value: {n_values} values, "
                                "{n_guess} predictions for {dtype}").format(
                                  n_values=len(values), n_guess=len(guess),
                                  dtype=dtype))
        truth = (torch.tensor(values, dtype=torch.float64).to(dtype) == 0).tolist()
        for v, g, t in zip(values, guess, truth):
            if bool(g) != t:
                raise WrongAnswer(
                    _("{v!r} in {dtype}: you said {value}, torch gives {value2}. "
                      "Hint: compare with the format's smallest subnormal (half of it "
                      "rounds to even, i.e. to 0).").format(
                        v=v, dtype=dtype, value='0' if g else 'nonzero',
                        value2='0' if t else 'nonzero'))
    passed(_("your underflow predictions match torch's casts"))


# ---- build it: one dynamic loss-scaler update that all ranks agree on ----------------

# (growth_interval, what each rank's gradients hold at each step): None, "inf" or
# "nan". The ranks disagree at some steps, and a NaN alone (no inf) must skip too.
SCALER_CASES = (
    (3, ((None, None), (None, None), (None, "inf"), ("nan", "nan"), (None, None),
         ("inf", None), (None, None), (None, None), (None, None), (None, "nan"),
         (None, None))),
    (2, ((None, None), (None, None), ("nan", None), (None, None), (None, None),
         (None, None))),
)
_INIT_SCALE = 2.0 ** 16


def scaler_truth(overflows: tuple[bool, ...], growth_interval: int,
                 init_scale: float = _INIT_SCALE) -> list[tuple[bool, float, int]]:
    """``(skip, scale, growth_tracker)`` after each step of a dynamic loss scaler
    with growth factor 2 and backoff 0.5 (GradScaler's defaults).

    Args:
        overflows: whether some rank overflowed, per step.
        growth_interval: clean steps in a row before the scale doubles.
        init_scale: the scale before the first step.
    Returns:
        One tuple per step.

    Taught in: Chapter 7, "Loss scaling".
    """
    scale, tracker, out = init_scale, 0, []
    for overflow in overflows:
        if overflow:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker = scale * 2.0, 0
        out.append((bool(overflow), scale, tracker))
    return out


class HostSyncs(TorchFunctionMode):
    """Inside the block, record each time a tensor's value is read on the host
    (``item``, ``bool``, ``float``, ``int``, ``tolist``, ``numpy``): on a GPU each
    one waits for the device. ``calls`` lists them by name."""

    READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__",
                       "tolist", "numpy"})

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.calls.append(name.strip("_") + "()")
        return func(*args, **(kwargs or {}))


def scaler_on_rank(step: Callable[..., tuple]) -> list[Any]:
    """On each of two ranks: the learner's update over each of :data:`SCALER_CASES`,
    with this rank's own (scaled) gradients.

    Args:
        step: the learner's ``step(grads, scale, growth_tracker, growth_interval)``.
    Returns:
        Per case, per step: ``(skip, scale, tracker, unscaled, host reads)``, or
        ``("bad", message)`` where what it returned was not three numbers.

    Taught in: Chapter 7, exercise "A loss-scaler step that the ranks agree on".
    """
    import torch.distributed as dist

    rank, device, out = dist.get_rank(), world().device, []
    for case, (interval, flags) in enumerate(SCALER_CASES):
        scale, tracker, steps = _INIT_SCALE, 0, []
        for i, per_rank in enumerate(flags):
            gen = torch.Generator().manual_seed(100 * case + 10 * i + rank)
            grads = [(torch.randn(n, generator=gen) * scale).to(device)
                     for n in (4, 3, 5)]
            if per_rank[rank]:
                # the bad value goes to each tensor in turn, at a drawn element: a
                # scaler that looks at one tensor, or one element, misses some
                poisoned = grads[(i + case + rank) % len(grads)]
                where = int(torch.randint(poisoned.numel(), (1,), generator=gen))
                poisoned[where] = float(per_rank[rank])
            want = [g / scale for g in grads]
            try:
                with HostSyncs() as syncs:
                    result = step(grads, scale, tracker, interval)
                skip, scale, tracker = result
                scale, tracker = float(scale), int(tracker)
            except (TypeError, ValueError) as err:
                steps.append(("bad", repr(err)))
                break
            unscaled = per_rank[rank] is not None or all(
                torch.allclose(g, w) for g, w in zip(grads, want))
            steps.append((bool(skip), scale, tracker, unscaled, syncs.calls))
        out.append(steps)
    return out


#: What ``check_scaler_step`` switches off while the learner's function runs.
_SCALER_STEP_FORBIDS = {
    'dtlib.exercises.precision:scaler_truth': N_("the checker's truth"),
    'dtlib.precision.loss_scaling:DynamicLossScaler.update':
        N_("the book's own scaler"),
    'dtlib.precision.loss_scaling:DynamicLossScaler.unscale_':
        N_("the book's own scaler"),
    'dtlib.precision.loss_scaling:simulate_scale': N_("the book's own scaler"),
    'torch.amp.grad_scaler:GradScaler.update': N_("torch's scaler"),
    'torch.amp.grad_scaler:GradScaler.unscale_': N_("torch's scaler"),
}


@checker(forbids=_SCALER_STEP_FORBIDS)
def check_scaler_step(step: Callable[..., tuple]) -> None:
    """Check ``step(grads, scale, growth_tracker, growth_interval)`` -> ``(skip,
    new_scale, new_growth_tracker)`` on two real ranks.

    Each rank unscales its own gradients in place; the ranks agree whether any of them
    holds an inf or a NaN (then all skip, the scale halves and the tracker resets);
    after ``growth_interval`` clean steps in a row the scale doubles and the tracker
    restarts. Growth factor 2, backoff 0.5, as GradScaler's defaults. Two sequences
    (:data:`SCALER_CASES`), two growth intervals, inf and NaN on one rank or both.
    """
    judge_scaler_steps(run_on_ranks(scaler_on_rank, step, 2, what=_(
            "your scaler step")))


def judge_scaler_steps(ranks: list[list[Any]]) -> None:
    """Raise :class:`WrongAnswer` unless both ranks' results of
    :func:`scaler_on_rank` agree with each other and with :func:`scaler_truth`;
    say so if they do.

    Args:
        ranks: what :func:`scaler_on_rank` returned on rank 0 and rank 1.
    Returns:
        None.

    Taught in: Chapter 7, exercise "A loss-scaler step that the ranks agree on".
    """
    for case, (interval, flags) in enumerate(SCALER_CASES):
        truth = scaler_truth([any(f) for f in flags], interval)
        for i, per_rank in enumerate(flags):
            if min(len(ranks[0][case]), len(ranks[1][case])) <= i:
                break  # a rank stopped early: its "bad" entry was reported above
            r0, r1 = ranks[0][case][i], ranks[1][case][i]
            where = (_("growth_interval={interval}, step {i} (rank 0 holds {value}, "
                       "rank 1 {value2})").format(
                         interval=interval, i=i,
                         value=per_rank[0] or 'finite values',
                         value2=per_rank[1] or 'finite values'))
            for r in (r0, r1):
                if r[0] == "bad":
                    raise WrongAnswer(_("{where}: return (skip, new_scale, "
                                        "new_growth_tracker) as numbers: {r_1}").format(
                                          where=where, r_1=r[1]))
            (skip0, s0, t0, u0, *sync0), (skip1, s1, t1, u1, *sync1) = r0, r1
            if skip0 != skip1 or s0 != s1:
                raise WrongAnswer(
                    _("{where}: the ranks disagree: rank 0 skip={skip0}, "
                      "scale={s0:g}; rank 1 skip={skip1}, scale={s1:g}. A rank that "
                      "steps while another skips makes the replicas drift "
                      "apart.").format(
                        where=where, skip0=skip0, s0=s0, skip1=skip1, s1=s1),
                    _("each rank sees only its own gradients; let every rank learn "
                      "whether any rank found an inf or a nan (one all-reduce of a "
                      "flag, with ReduceOp.MAX)"))
            want_skip, want_scale, want_tracker = truth[i]
            if skip0 != want_skip:
                raise WrongAnswer(f"{where}: skip={skip0}.", _(
                        "a step is skipped when, and only when, some rank's gradients "
                        "hold an inf or a nan (torch.isfinite catches both)"))
            if s0 != want_scale:
                side = _("too large") if s0 > want_scale else _(
                        "too small")
                raise WrongAnswer(_("{where}: the scale afterwards is {side}.").format(
                                      where=where, side=side),
                                  _("halve after an overflow and restart counting "
                                    "clean steps; double after {interval} clean steps "
                                    "in a row ('Loss scaling')").format(
                                      interval=interval))
            if t0 != want_tracker or t1 != want_tracker:
                raise WrongAnswer(
                    _("{where}: you returned growth_tracker={t0} (rank 0), {t1} (rank "
                      "1).").format(where=where, t0=t0, t1=t1), _(
                              "the tracker counts clean steps since the last overflow "
                              "or growth: +1 after a clean step, back to 0 after an "
                              "overflow and when the scale grows"))
            if not (u0 and u1):
                raise WrongAnswer(_("{where}: the gradients were not unscaled in "
                                    "place (divided by the scale the loss was "
                                    "multiplied by).").format(where=where))
            for rank, reads in ((0, sync0), (1, sync1)):
                if reads and len(reads[0]) > 1:
                    raise WrongAnswer(
                        _("{where}: rank {rank} read tensors on the host {n_reads_0} "
                          "times in one step ({join}): on a GPU each one waits for "
                          "the device.").format(
                            where=where, rank=rank, n_reads_0=len(reads[0]),
                            join=', '.join(reads[0])), _(
                                    "the exercise asks for one host synchronisation "
                                    "per step: combine the tensors' checks into one "
                                    "flag on the device, all-reduce it, and read it "
                                    "once"))
    passed(_("both ranks skip together on inf and NaN and update scale and tracker "
             "like GradScaler, over {n_scaler_cases} sequences").format(
               n_scaler_cases=len(SCALER_CASES)))


# ---- a reduce-scatter in reduce_dtype into fp32 master shards ------------------------

#: The dtypes the checker asks the reduce-scatter in, one case each.
REDUCE_CASES = (torch.float32, torch.bfloat16)
_GRAD_NUMEL = 24  # divides 2 and 4 ranks


def rank_gradient(case: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s full flat bf16 gradient of case ``case`` (the same on every
    call): normal values whose sums need more than bf16's 8 significant bits.

    Taught in: Chapter 7, exercise "A reduce-scatter in reduce_dtype".
    """
    gen = torch.Generator().manual_seed(1000 + 10 * case + rank)
    return torch.randn(_GRAD_NUMEL, generator=gen).to(torch.bfloat16)


def grad_shard_truth(case: int, world_size: int, reduce_dtype: torch.dtype
                     ) -> list[torch.Tensor]:
    """Every rank's averaged fp32 gradient shard, the sum done in ``reduce_dtype``
    (bf16: rounded after each addition, in rank order; the division by a power of
    two is exact).

    Taught in: Chapter 7, exercise "A reduce-scatter in reduce_dtype".
    """
    grads = [rank_gradient(case, r) for r in range(world_size)]
    if reduce_dtype == torch.float32:
        mean = (torch.stack([g.double() for g in grads]).sum(0) / world_size).float()
    else:
        acc = grads[0].to(reduce_dtype)
        for g in grads[1:]:
            acc = (acc.double() + g.double()).to(reduce_dtype)
        mean = (acc / world_size).float()
    return list(mean.chunk(world_size))


def grad_shards_on_rank(reduce: Callable[..., torch.Tensor]) -> list[Any]:
    """On every rank: the learner's ``reduce(grad, reduce_dtype)`` for each of
    :data:`REDUCE_CASES`, given this rank's bf16 gradient.

    Returns:
        Per case ``("ok", shard on the CPU)`` or ``("bad", message)``.

    Taught in: Chapter 7, exercise "A reduce-scatter in reduce_dtype".
    """
    import torch.distributed as dist

    out: list[Any] = []
    for case, reduce_dtype in enumerate(REDUCE_CASES):
        grad = rank_gradient(case, dist.get_rank()).to(world().device)
        try:
            with count_comms() as log:
                shard = reduce(grad.clone(), reduce_dtype)
        except (TypeError, ValueError, RuntimeError) as err:
            out.append(("bad", _("your reduce raised {type}: {err}").format(
                                   type=type(err).__name__, err=err)))
            continue
        if not torch.is_tensor(shard):
            out.append(("bad", _("returned {type}, not a tensor").format(
                                   type=type(shard).__name__)))
            continue
        # the method: only reduce-scatters, in reduce_dtype (the wire's dtype)
        wire = sorted({(r.op, r.dtype.removeprefix("torch.")) for r in log.records})
        asked = str(reduce_dtype).removeprefix("torch.")
        if wire != [("reduce_scatter", asked)]:
            out.append(("bad", _("your collectives were {value} (op, dtype): the "
                                 "exercise asks for a reduce-scatter in {asked}, the "
                                 "dtype on the wire, and nothing else").format(
                                   value=wire or 'none', asked=asked)))
            continue
        out.append(("ok", shard.detach().cpu()))
    return out


def judge_grad_shards(ranks: list[list[Any]]) -> None:
    """Raise :class:`WrongAnswer` unless every rank's shard of every case is its
    averaged fp32 gradient shard, reduced in the dtype asked; say so if they are.

    The sum of two bf16 values is exact in fp32 (8 significant bits each), so the
    fp32 truth is exact up to one rounding (tolerance 4 u32 of the largest element);
    a bf16 sum rounds about half of the elements by up to 2**-9 relative, far more.

    Taught in: Chapter 7, exercise "A reduce-scatter in reduce_dtype".
    """
    n = len(ranks)
    for case, reduce_dtype in enumerate(REDUCE_CASES):
        asked = str(reduce_dtype).removeprefix("torch.")
        truth = grad_shard_truth(case, n, reduce_dtype)
        other = grad_shard_truth(case, n, REDUCE_CASES[1 - case])
        tol = 4 * 2.0 ** -24 * max(float(t.abs().max()) for t in truth)
        for rank, (status, got) in enumerate(r[case] for r in ranks):
            where = _("reduce_dtype={asked}, rank {rank}").format(
                        asked=asked, rank=rank)
            if status == "bad":
                raise WrongAnswer(f"{where}: {got}")
            if got.dtype != torch.float32:
                raise WrongAnswer(_("{where}: the shard is {dtype}.").format(
                                      where=where, dtype=got.dtype),
                                  _("the master gradient shard is fp32 whatever dtype "
                                    "the reduce-scatter ran in: cast the result up"))
            if got.shape != truth[rank].shape:
                raise WrongAnswer(_("{where}: shape {shape}; each rank keeps 1/{n} of "
                                    "the flat gradient.").format(
                                      where=where, shape=tuple(got.shape), n=n))

            def near(want: torch.Tensor) -> bool:
                return bool((got - want).abs().max() <= tol)

            if near(truth[rank]):
                continue
            if near(other[rank]):
                raise WrongAnswer(
                    _("{where}: your shard is the sum done in {removeprefix}.").format(
                        where=where,
                        removeprefix=str(REDUCE_CASES[1 - case]).removeprefix(
                            'torch.')),
                    _("cast the gradient to reduce_dtype ({asked}) before the "
                      "reduce-scatter: the collective sums in its input's "
                      "dtype").format(asked=asked))
            if near(truth[rank] * n):
                raise WrongAnswer(_("{where}: the shard is {n} times too "
                                    "large.").format(where=where, n=n),
                                  _("the reduce-scatter sums; the gradient is the "
                                    "average over the ranks"))
            if any(near(t) for r, t in enumerate(truth) if r != rank):
                raise WrongAnswer(_("{where}: that is another rank's shard.").format(
                                      where=where),
                                  _("rank r keeps elements [r * n, (r + 1) * n) of "
                                    "the flat gradient"))
            raise WrongAnswer(_("{where}: the shard is not the averaged "
                                "gradient.").format(where=where))
    passed(_("fp32 master gradient shards on {n} ranks, reduced in fp32 and in bf16 "
             "as asked").format(n=n))


#: What ``check_grad_shard_reduce`` switches off while the learner's function runs.
_GRAD_SHARD_REDUCE_FORBIDS = {
    'dtlib.exercises.precision:grad_shard_truth': N_("the checker's truth"),
}


@checker(forbids=_GRAD_SHARD_REDUCE_FORBIDS)
def check_grad_shard_reduce(reduce: Callable[..., torch.Tensor]) -> None:
    """Check ``reduce(grad, reduce_dtype)`` -> this rank's averaged gradient shard in
    fp32, on two real ranks: ``grad`` is the rank's full flat bf16 gradient, the
    reduce-scatter must run in ``reduce_dtype`` (fp32, then bf16).
    """
    judge_grad_shards(run_on_ranks(grad_shards_on_rank, reduce, 2,
                                   what=_("your reduce-scatter")))
