"""Checkers for Chapter 6, "Pipeline parallel"."""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from dtlib.exercises import WrongAnswer, as_number, checker, passed, run_on_ranks
from dtlib.pipeline_parallel.schedules import in_flight_peak, simulate
from dtlib.runtime.i18n import N_, _

# ---- reason it out: when does a stage start its first backward? ----------------------

# Beyond the page's picture (p = 4, m = 8, t_f = 1, t_b = 2): other depths, micro-batch
# counts (fewer than the stages too) and cost ratios, a backward cheaper than a forward
# included. Every cost is a small binary fraction, so the clock's sums are exact.
_FB_GRID = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (1, 2, 3, 5, 8, 16)]
_FB_COSTS = ((1.0, 2.0), (1.0, 1.0), (2.0, 3.0), (0.5, 1.5), (3.0, 1.0))


#: What ``check_first_backward`` switches off while the learner's function runs.
_FIRST_BACKWARD_FORBIDS = {
    'dtlib.pipeline_parallel.schedules:simulate': N_("the checker's truth"),
    'dtlib.pipeline_parallel.schedules:schedule_order': N_("the book's simulator"),
    'dtlib.pipeline_parallel.interleaved:simulate_interleaved':
        N_("the book's simulator"),
}


@checker(forbids=_FIRST_BACKWARD_FORBIDS)
def check_first_backward(predict: Callable[..., float],
                         seed: int | None = None) -> None:
    """Check ``predict(schedule, stage, n_stages, n_microbatches, t_f, t_b)``: the time
    at which stage ``stage`` starts its first backward on the ideal clock of
    :func:`dtlib.pipeline_parallel.schedules.simulate` (messages free, a forward takes
    ``t_f``, a backward ``t_b``, the step starts at 0).

    The grid of depths, micro-batch counts and costs, and drawn from ``seed``: one more
    depth and count (up to 12 stages, 24 micro-batches) and two more cost pairs (in
    eighths, exact binary fractions like the grid's)."""
    rng = random.Random(seed)
    grid = [*_FB_GRID, (rng.randint(1, 12), rng.randint(1, 24))]
    costs = [*_FB_COSTS, *((rng.randint(1, 32) / 8, rng.randint(1, 32) / 8)
                           for _ in range(2))]
    for schedule in ("gpipe", "1f1b"):
        for p, m in grid:
            for t_f, t_b in costs:
                events = simulate(schedule, p, m, t_f, t_b)
                for s in range(p):
                    want = min(e.start for e in events
                               if e.stage == s and e.kind == "B")
                    got = predict(schedule, s, p, m, t_f, t_b)
                    if as_number(got) is None:
                        raise WrongAnswer(_("predict returned {got!r}: return a time, "
                                            "a number").format(got=got))
                    got = as_number(got)
                    # the clock adds exact binary fractions: only the learner's own
                    # rounding (a division, say) may differ, by a few ulps
                    if not math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12):
                        side = _("late") if got > want else _("early")
                        raise WrongAnswer(
                            _("{schedule}, stage {s} of p={p}, m={m}, t_f={t_f:g}, "
                              "t_b={t_b:g}: {got!r} is too {side}.").format(
                                schedule=schedule, s=s, p=p, m=m, t_f=t_f, t_b=t_b,
                                got=got, side=side),
                            _("which micro-batch's backward runs first under this "
                              "schedule? Follow it: its forward must leave the last "
                              "stage, then its gradient comes back one stage at a "
                              "time, each stage spending one backward on it ('Two "
                              "schedules')."))
    passed(_("your first-backward times match the ideal clock for both schedules, p "
             "up to {max}, and {n__fb_costs} cost ratios").format(
               max=max((p for p, _ in _FB_GRID)), n__fb_costs=len(_FB_COSTS)))


# ---- build it: one GPipe step of a two-stage pipeline, on two real ranks -------------

_PP_BATCH = 2
# (micro-batches, hidden width): the page's exercise shape and one it does not show
_PP_CONFIGS = ((3, 8), (4, 5))


def _pp_stages(hidden: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh()),
            torch.nn.Linear(hidden, 3)]


def _pp_data(n_micro: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(_PP_BATCH, 4, generator=gen) for _ in range(n_micro)]
    ys = [torch.randn(_PP_BATCH, 3, generator=gen) for _ in range(n_micro)]
    return xs, ys


class _Recv:
    """A receive's request: notes in the trace when the learner's wait returns."""

    def __init__(self, work: Any, done: Callable[[], None]) -> None:
        self._work, self._done, self._noted = work, done, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if not self._noted:
            self._noted = True
            self._done()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _P2PTrace:
    """While active, record this rank's point-to-point traffic and its stage's work.

    ``trace`` gets ``("F",)`` when a forward of the stage starts (``("f",)`` when it
    is a recomputation inside a backward), ``("B",)`` when a
    backward reaches its first parameter, ``("S", shape)`` when a send is posted and
    ``("R", shape)`` when a receive has completed (a blocking ``recv`` returned, or
    the learner's ``wait`` on an ``irecv``). ``send``/``recv`` are ``isend``/``irecv``
    plus ``wait`` in torch >= 2.7; wrapping all four in both namespaces sees either.
    """

    def __init__(self, stage: torch.nn.Module) -> None:
        self.trace: list[tuple[Any, ...]] = []
        self._depth = 0
        self._stage = stage
        self._saved: list[tuple[Any, str, Any]] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> "_P2PTrace":
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        orig = {n: getattr(c10d, n) for n in ("send", "recv", "isend", "irecv")}
        trace = self.trace

        def isend(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            if not self._depth:
                trace.append(("S", tuple(tensor.shape)))
            return orig["isend"](tensor, *a, **k)

        def irecv(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            work = orig["irecv"](tensor, *a, **k)
            if self._depth or work is None:
                return work
            return _Recv(work, lambda: trace.append(("R", tuple(tensor.shape))))

        def send(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            trace.append(("S", tuple(tensor.shape)))
            self._depth += 1
            try:
                return orig["send"](tensor, *a, **k)
            finally:
                self._depth -= 1

        def recv(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            self._depth += 1
            try:
                out = orig["recv"](tensor, *a, **k)
            finally:
                self._depth -= 1
            trace.append(("R", tuple(tensor.shape)))
            return out

        for module in (dist, c10d):  # the same function objects in both namespaces
            for name, fn in (("send", send), ("recv", recv), ("isend", isend),
                             ("irecv", irecv)):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, fn)
        def forward_starts(*_: Any) -> None:
            # a forward the autograd engine runs is a recomputation
            # (torch.utils.checkpoint), inside a backward: not a micro-batch's forward
            task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
            trace.append(("f",) if task != -1 else ("F",))

        self._hooks.append(self._stage.register_forward_pre_hook(forward_starts))
        first = next(self._stage.parameters())
        self._hooks.append(first.register_hook(lambda g: trace.append(("B",))))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        for hook in self._hooks:
            hook.remove()


def _pp_on_rank(steps: tuple[Callable[..., Any], ...]) -> list[list[dict[str, Any]]]:
    """On each of two ranks, per step and config: the step with this rank's stage and
    data, the stage's gradients and the trace of what the rank did in which order."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for step in steps:
        per_config = []
        for n_micro, hidden in _PP_CONFIGS:
            stage = _pp_stages(hidden)[rank]
            xs, ys = _pp_data(n_micro)
            with _P2PTrace(stage) as rec:
                loss = step(stage, xs if rank == 0 else None,
                            ys if rank == 1 else None, (_PP_BATCH, hidden))
            if isinstance(loss, torch.Tensor):
                loss = loss.item()
            per_config.append({"loss": loss, "trace": rec.trace,
                               "grads": [None if p.grad is None else p.grad.clone()
                                         for p in stage.parameters()]})
        out.append(per_config)
    return out


def _pp_truth(n_micro: int, hidden: int) -> dict[str, Any]:
    stages = _pp_stages(hidden)
    xs, ys = _pp_data(n_micro)
    losses = [F.mse_loss(stages[1](stages[0](x)), y) / n_micro for x, y in zip(xs, ys)]
    sum(losses).backward()
    return {"loss": sum(l.item() for l in losses),
            "grads": [[p.grad for p in s.parameters()] for s in stages]}


def _check_numbers(res: list[dict[str, Any]], n_micro: int, hidden: int) -> None:
    """Loss on rank 1 and both stages' gradients against one process."""
    truth = _pp_truth(n_micro, hidden)
    loss = res[1]["loss"]
    if as_number(loss) is None:
        raise WrongAnswer(_("rank 1 returned {loss!r}: return the summed loss, a "
                            "number").format(loss=loss))
    loss = as_number(loss)
    # float32 sums of a handful of terms, in another order: ~1e-7 relative; 1e-5 is
    # far below the factor m that the usual mistake makes
    if abs(loss - truth["loss"] * n_micro) < 1e-5 * abs(truth["loss"] * n_micro):
        raise WrongAnswer(_("the loss is len(targets) times too large."),
                          _("each micro-batch's loss is divided by the number of "
                            "micro-batches, so that the step's gradient is the mean's"))
    if abs(loss - truth["loss"]) > 1e-5 * abs(truth["loss"]):
        raise WrongAnswer(_("rank 1's summed loss, {loss:.6g}, is not one process's "
                            "on the same micro-batches.").format(loss=loss))
    for rank, name in ((1, _("the second stage (rank 1)")),
                       (0, _("the first stage (rank 0)"))):
        for got, want in zip(res[rank]["grads"], truth["grads"][rank]):
            if got is None:
                raise WrongAnswer(
                    _("{name} has no gradient.").format(name=name), _(
                            "rank 1 must send each micro-batch's activation gradient "
                            "back (the input's .grad, which needs requires_grad_()), "
                            "and rank 0 must call y.backward(grad) on the output it "
                            "sent ('Two schedules')."))
            # the same float32 sums in another order (see above): rtol 1e-4 with an
            # atol for elements near zero, both far below a factor m or a lost term
            if torch.allclose(got, want * n_micro, rtol=1e-4, atol=1e-6):
                raise WrongAnswer(
                    _("{name}: gradients are len(targets) times too large.").format(
                        name=name))
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                raise WrongAnswer(_("{name}: gradients differ from one "
                                    "process's.").format(name=name),
                                  _("pair each activation gradient with the output of "
                                    "the same micro-batch"))


def _positions(trace: list[tuple[Any, ...]], kind: str) -> list[int]:
    return [i for i, ev in enumerate(trace) if ev[0] == kind]


def _check_pipelined(res: list[dict[str, Any]], n_micro: int, hidden: int) -> None:
    """The order of each rank's work and messages is GPipe's, message by message.

    GPipe on two stages: each rank runs every forward, then every backward; rank 0
    sends each activation before it starts the next forward, rank 1 starts each
    forward before its next activation arrives, and in backward the roles swap. A
    step that holds messages back (all forwards, then all sends; one concatenated
    message) or runs a micro-batch's backward before the next one's forward keeps the
    other stage waiting: it computes the same numbers without pipelining.
    """
    act = (_PP_BATCH, hidden)
    for rank in (0, 1):
        trace = res[rank]["trace"]
        shown = " ".join(ev[0] for ev in trace) or "(nothing)"
        recomputed = (_(", f forward recomputed in a backward")
                      if any(ev[0] == "f" for ev in trace) else "")
        where = (_("m={n_micro}: rank {rank} did, in order (F forward, B backward, S "
                   "send posted, R receive done{recomputed}): {shown}.").format(
                     n_micro=n_micro, rank=rank, recomputed=recomputed, shown=shown))
        for kind, what in (("F", _("forwards")), ("B", _("backwards")),
                           ("S", _("sends")), ("R", _("receives"))):
            n = len(_positions(trace, kind))
            if n != n_micro:
                raise WrongAnswer(
                    _("{where} That is {n} {what} for {n_micro} micro-batches.").format(
                        where=where, n=n, what=what, n_micro=n_micro),
                    _("a pipeline moves one micro-batch at a time: one forward, one "
                      "backward, one message each way per micro-batch, each sent as "
                      "soon as it exists (dist.send / dist.recv, or isend / irecv and "
                      "wait)"))
        bad = [ev[1] for ev in trace if ev[0] in "SR" and ev[1] != act]
        if bad:
            raise WrongAnswer(_("{where} A message of shape {bad_0}: each one is one "
                                "micro-batch's activation or its gradient, "
                                "{act}.").format(where=where, bad_0=bad[0], act=act))
        fwd, bwd = _positions(trace, "F"), _positions(trace, "B")
        sends, recvs = _positions(trace, "S"), _positions(trace, "R")
        if bwd[0] < fwd[-1]:
            raise WrongAnswer(
                _("{where} A backward runs before the last forward: one micro-batch "
                  "at a time (or 1F1B), not GPipe.").format(where=where),
                _("GPipe runs every micro-batch's forward first, then every backward; "
                  "the other stage works on micro-batch i while this one does i + 1 "
                  "('Two schedules')"))
        # sender: message k leaves before compute k + 1 starts; receiver: compute k
        # starts before message k + 1 is taken in
        produce, consume = (fwd, bwd) if rank == 0 else (bwd, fwd)
        for k in range(n_micro - 1):
            if sends[k] > produce[k + 1]:
                raise WrongAnswer(
                    _("{where} Message {k} leaves only after the next micro-batch's "
                      "work has started: the other stage waits idle meanwhile.").format(
                        where=where, k=k),
                    _("send each micro-batch's result as soon as it is computed, "
                      "before computing the next one"))
            if consume[k] > recvs[k + 1]:
                raise WrongAnswer(
                    _("{where} The work on micro-batch {k} starts only after message "
                      "{value} has been received: this stage waited for the other's "
                      "next result before starting on the first.").format(
                        where=where, k=k, value=k + 1),
                    _("start on each micro-batch as soon as its message is in, before "
                      "receiving the next one"))


def pipeline_step_verdicts(steps: Sequence[Callable[..., Any]]
                           ) -> list[WrongAnswer | None]:
    """Judge several two-stage steps in one launch of two ranks (one after the other on
    the same ranks): the work of :func:`check_pipeline_step`, which judges one.

    Args:
        steps: functions ``step(stage, micro_batches, targets, act_shape)``.
    Returns:
        Per step, the :class:`WrongAnswer` it earns, or None for a right one.

    Taught in: Chapter 6, exercise "One GPipe step on two ranks".
    """
    # a right step takes well under a second a shape: a hang (a receive nobody
    # sends) is reported after 10 s, and 5 s more for each step judged
    ranks = run_on_ranks(_pp_on_rank, tuple(steps), 2, timeout=10 + 5 * len(steps),
                         what=_("your pipeline step"))
    verdicts: list[WrongAnswer | None] = []
    for k in range(len(steps)):
        try:
            for i, (n_micro, hidden) in enumerate(_PP_CONFIGS):
                res = [ranks[0][k][i], ranks[1][k][i]]
                _check_numbers(res, n_micro, hidden)
                _check_pipelined(res, n_micro, hidden)
        except WrongAnswer as exc:
            verdicts.append(exc)
        else:
            verdicts.append(None)
    return verdicts


#: What ``check_pipeline_step`` switches off while the learner's function runs.
_PIPELINE_STEP_FORBIDS = {
    'dtlib.pipeline_parallel.schedules:pipeline_step':
        N_("the book's own pipeline step"),
    'dtlib.exercises.pipeline_parallel:_pp_truth': N_("the checker's truth"),
    'torch.distributed.pipelining.schedules:PipelineScheduleSingle.step':
        N_("torch's pipeline schedules"),
    'torch.distributed.pipelining.schedules:PipelineScheduleMulti.step':
        N_("torch's pipeline schedules"),
}


@checker(forbids=_PIPELINE_STEP_FORBIDS)
def check_pipeline_step(step: Callable[..., Any]) -> None:
    """Check ``step(stage, micro_batches, targets, act_shape)`` on two real ranks.

    Rank 0 holds the first stage and the input micro-batches (``targets`` is None),
    rank 1 the second stage and the targets (``micro_batches`` is None); activations
    of shape ``act_shape`` go 0 -> 1 and their gradients 1 -> 0 by send/recv (or
    isend/irecv and wait). The loss of a micro-batch is ``F.mse_loss(output, target) /
    len(targets)``. Rank 1 returns the summed loss, rank 0 anything; both stages'
    gradients must equal one process's on the whole batch, and the order of each
    rank's forwards, backwards and messages must be GPipe's (:func:`_check_pipelined`).
    Two shapes run: the page's and one it does not show.
    """
    (verdict,) = pipeline_step_verdicts([step])
    if verdict is not None:
        raise verdict
    passed(_("your two-stage GPipe step equals one process (loss and gradients) and "
             "sends, receives and computes in GPipe's order, for {counts} "
             "micro-batches").format(
                 counts=" / ".join(str(m) for m, _n in _PP_CONFIGS)))


# ---- schedule it: W into the holes (zero bubble, ZB-H1's memory) ------------------

#: Depths and micro-batch counts always tried (the page's p = 4, m = 8 first; fewer
#: micro-batches than stages too) and the (t_F, t_B, t_W) the clock runs them at: W no
#: longer than F or B, in exact binary fractions.
_ZB_GRID = ((4, 8), (2, 2), (2, 5), (3, 3), (3, 7), (4, 3), (5, 10))
_ZB_TIMES = ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 0.5))

#: What ``check_zero_bubble_order`` switches off while the learner's function runs.
_ZB_ORDER_FORBIDS = {
    'dtlib.pipeline_parallel.schedules:schedule_order': N_("the book's own orders"),
    'dtlib.pipeline_parallel.schedules:simulate': N_("the checker's truth"),
    'dtlib.pipeline_parallel.interleaved:interleaved_order':
        N_("the book's own orders"),
}


def _zb_form(order: Any, stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """The learner's order as (kind, micro-batch) pairs, or a WrongAnswer saying
    what is malformed or missing."""
    where = _("stage {stage} of p={p}, m={m}").format(stage=stage, p=p, m=m)
    try:
        pairs = [(str(k).upper(), int(i)) for k, i in order]
    except (TypeError, ValueError):
        raise WrongAnswer(_("{where}: return a list of (kind, micro-batch) pairs such "
                            "as ('F', 0), ('B', 0), ('W', 0)").format(where=where))
    for kind in "FBW":
        got = sorted(i for k, i in pairs if k == kind)
        if got != list(range(m)):
            raise WrongAnswer(_("{where}: each micro-batch 0..{last} needs exactly one "
                                "{kind}; yours has {got}").format(
                                    where=where, last=m - 1, kind=kind, got=got))
    if len(pairs) != 3 * m:
        raise WrongAnswer(_("{where}: only F, B and W actions, each micro-batch once "
                            "each").format(where=where))
    seen: set[tuple[str, int]] = set()
    for k, i in pairs:
        need = {"B": ("F", i), "W": ("B", i)}.get(k)
        if need is not None and need not in seen:
            raise WrongAnswer(_("{where}: {k}{i} comes before {need}{i} on the same "
                                "stage; it needs what that one computes").format(
                                    where=where, k=k, i=i, need=need[0]))
        seen.add((k, i))
    return pairs


@checker(forbids=_ZB_ORDER_FORBIDS)
def check_zero_bubble_order(zb_order: Callable[[int, int, int], Any],
                            seed: int | None = None) -> None:
    """Check ``zb_order(stage, n_stages, n_microbatches)``: one stage's action list of
    a split-backward schedule (F, B and W of every micro-batch) that holds at most
    ``p`` micro-batches' activations on any stage (1F1B's peak) and whose step on the
    ideal clock (:func:`dtlib.pipeline_parallel.schedules.play`) is no longer than
    ZB-H1's, for every (t_F, t_B, t_W) with t_W <= min(t_F, t_B).

    The grid, and two (p, m) drawn from ``seed`` (up to 8 stages, 20 micro-batches)
    with one more triple of times."""
    rng = random.Random(seed)
    grid = [*_ZB_GRID, *((rng.randint(2, 8), rng.randint(1, 20)) for _ in range(2))]
    t_f, t_b = rng.randint(4, 16) / 8, rng.randint(4, 16) / 8
    times = [*_ZB_TIMES, (t_f, t_b, rng.randint(1, int(8 * min(t_f, t_b))) / 8)]
    from dtlib.pipeline_parallel.schedules import play

    for p, m in grid:
        orders = [_zb_form(zb_order(s, p, m), s, p, m) for s in range(p)]
        for s, order in enumerate(orders):
            if in_flight_peak(order) > p:
                raise WrongAnswer(
                    _("stage {s} of p={p}, m={m} holds {held} micro-batches' "
                      "activations at once (a micro-batch is held from its F until "
                      "its W); 1F1B holds at most {p}").format(
                          s=s, p=p, m=m, held=in_flight_peak(order)),
                    _("run each W soon enough: a stage that holds back more W's "
                      "than the holes need keeps their activations too"))
        for tf, tb, tw in times:
            try:
                events = play(orders, tf, tb, tw)
            except RuntimeError:
                raise WrongAnswer(_("p={p}, m={m}: your orders deadlock: some stage "
                                    "waits for an action that never comes").format(
                                        p=p, m=m),
                                  _("a stage's B needs the next stage's B of the "
                                    "same micro-batch; check the warm-up"))
            got = max(e.end for e in events)
            want = max(e.end for e in simulate("zb-h1", p, m, tf, tb, tw))
            if got > want + 1e-9:
                raise WrongAnswer(
                    _("p={p}, m={m}, t_F={tf:g}, t_B={tb:g}, t_W={tw:g}: your step "
                      "takes {got:g} on the ideal clock, ZB-H1's {want:g}").format(
                          p=p, m=m, tf=tf, tb=tb, tw=tw, got=got, want=want),
                    _("a W is wanted where the stage would idle: in the drain, and "
                      "in the warm-up's holes of the stages that wait longest "
                      "('Splitting the backward')"))
    passed(_("your orders hold at most p micro-batches and are as short as ZB-H1's on "
             "the ideal clock, for {n} depths and micro-batch counts and {k} sets of "
             "F, B and W times").format(n=len(grid), k=len(times)))


# ---- split it: B now, W later, on two ranks ------------------------------------------

#: What ``check_split_backward`` switches off while the learner's functions run.
_SPLIT_FORBIDS = {
    'dtlib.pipeline_parallel.zero_bubble:backward_input': N_("the book's own B"),
    'dtlib.pipeline_parallel.zero_bubble:backward_weight': N_("the book's own W"),
    'dtlib.pipeline_parallel.schedules:pipeline_step':
        N_("the book's own pipeline step"),
    'dtlib.exercises.pipeline_parallel:_split_truth': N_("the checker's truth"),
}
#: The page's case first: (hidden width, layers a stage, micro-batches, data seed).
_SPLIT_PAGE = (8, 1, 4, 0)
_SPLIT_ROWS = 2


_SPLIT_RANKS = 3  # a first, a middle and a last stage


def _split_stages(hidden: int, depth: int, seed: int) -> list[torch.nn.Module]:
    """:data:`_SPLIT_RANKS` stages of ``depth`` Linear + Tanh layers each (the first
    from 4 inputs), the last ending in a Linear to 3 outputs, initialised from
    ``seed``."""
    torch.manual_seed(seed)
    stages: list[torch.nn.Module] = []
    for s in range(_SPLIT_RANKS):
        layers: list[torch.nn.Module] = []
        for k in range(depth):
            layers += [torch.nn.Linear(4 if s == k == 0 else hidden, hidden),
                       torch.nn.Tanh()]
        if s == _SPLIT_RANKS - 1:
            layers.append(torch.nn.Linear(hidden, 3))
        stages.append(torch.nn.Sequential(*layers))
    return stages


def _split_data(m: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    return ([torch.randn(_SPLIT_ROWS, 4, generator=gen) for _ in range(m)],
            [torch.randn(_SPLIT_ROWS, 3, generator=gen) for _ in range(m)])


def _split_on_rank(fns: tuple[Callable[..., Any], Callable[..., Any]],
                   cases: tuple[tuple[int, int, int, int], ...]
                   ) -> list[dict[str, Any]]:
    """On each rank and per case: this rank's stage trained through ZB-H1's order
    (F, B, W) with the learner's B and W, activations and their gradients passed by
    the checker; the stage's gradients, and what went wrong where."""
    import torch.distributed as dist

    from dtlib.pipeline_parallel.schedules import schedule_order

    b_fn, w_fn = fns
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    out = []
    for hidden, depth, m, seed in cases:
        stage = _split_stages(hidden, depth, seed)[rank]
        params = list(stage.parameters())
        xs, ys = _split_data(m, seed)
        held: dict[int, tuple[Any, torch.Tensor]] = {}
        saved: dict[int, Any] = {}
        sends: list[Any] = []
        problem = None
        computed = [0]  # weight gradients autograd computed, however it was asked

        def count(g: torch.Tensor) -> None:
            computed[0] += 1

        hooks = [q.register_hook(count) for q in params]
        for kind, i in schedule_order("zb-h1", rank, p, m):
            if kind == "F":
                if first:
                    x, y = None, stage(xs[i])
                else:
                    x = torch.empty(_SPLIT_ROWS, hidden)
                    dist.recv(x, rank - 1)
                    x.requires_grad_(True)
                    y = stage(x)
                if last:
                    y = F.mse_loss(y, ys[i]) / m
                else:
                    sends.append(dist.isend(y.detach(), rank + 1))
                held[i] = (x, y)
            elif kind == "B":
                x, y = held.pop(i)
                grad = None
                if not last:
                    grad = torch.empty_like(y)
                    dist.recv(grad, rank + 1)
                before = [None if q.grad is None else q.grad.clone() for q in params]
                computed[0] = 0
                x_grad, saved[i] = b_fn(y, grad, x, params)
                changed = [k for k, (q, b) in enumerate(zip(params, before))
                           if (q.grad is None) != (b is None)
                           or (b is not None and not torch.equal(q.grad, b))]
                if (changed or computed[0]) and problem is None:
                    problem = ("b_weights", i)
                if not first:
                    if not isinstance(x_grad, torch.Tensor) or \
                            tuple(x_grad.shape) != tuple(x.shape):
                        problem = problem or ("x_grad", i)
                        x_grad = torch.zeros_like(x)
                    sends.append(dist.isend(x_grad.detach().contiguous(), rank - 1))
            else:
                w_fn(saved.pop(i), params)
        for work in sends:
            work.wait()
        for hook in hooks:
            hook.remove()
        out.append({"grads": [None if q.grad is None else q.grad.clone()
                              for q in params], "problem": problem})
    return out


def _split_truth(hidden: int, depth: int, m: int, seed: int
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both stages' gradients on one process (the fused backward of each micro-batch,
    accumulated in order), and each entry's sum of the micro-batches' magnitudes."""
    stages = _split_stages(hidden, depth, seed)
    params = [p for s in stages for p in s.parameters()]
    xs, ys = _split_data(m, seed)
    total = [torch.zeros_like(p) for p in params]
    magnitude = [torch.zeros_like(p) for p in params]
    for x, y in zip(xs, ys):
        for st in stages:
            x = st(x)
        loss = F.mse_loss(x, y) / m
        grads = torch.autograd.grad(loss, params)
        for t, a, g in zip(total, magnitude, grads):
            t += g
            a += g.abs()
    return total, magnitude


@checker(forbids=_SPLIT_FORBIDS)
def check_split_backward(backward_b: Callable[..., Any],
                         backward_w: Callable[..., Any],
                         seed: int | None = None) -> None:
    """Check ``backward_b(out, grad, x, params) -> (x_grad, saved)`` and
    ``backward_w(saved, params)`` on three real ranks (a first, a middle and a last
    stage) running ZB-H1's order.

    ``out`` is the stage's output (the last: the micro-batch's loss, ``grad`` None),
    ``x`` its input (None on rank 0, where the micro-batches enter), ``params`` the
    stage's parameters. B must return ``dL/dx`` (sent to the previous stage) and must
    leave every ``.grad`` as it found it; W, called later with what B returned, adds
    the micro-batch's weight gradients into ``.grad``. Both stages' gradients after
    the step must be every stage's on one process, within the reordering of ``m``
    sums. The page's case and two drawn from ``seed`` (widths, layers a stage,
    micro-batches).
    """
    rng = random.Random(seed)
    cases = (_SPLIT_PAGE, *((rng.randint(3, 9), rng.randint(1, 3), rng.randint(2, 6),
                             rng.randint(1, 10**6)) for _ in range(2)))
    ranks = run_on_ranks(_split_on_rank, (backward_b, backward_w), _SPLIT_RANKS,
                         cases, timeout=60, what=_("your B and W"))
    eps = torch.finfo(torch.float32).eps
    for c, (hidden, depth, m, case_seed) in enumerate(cases):
        where = _("width {hidden}, {depth} layer(s) a stage, {m} micro-batches").format(
            hidden=hidden, depth=depth, m=m)
        for rank in range(_SPLIT_RANKS):
            problem = ranks[rank][c]["problem"]
            if problem and problem[0] == "b_weights":
                raise WrongAnswer(
                    _("{where}: on rank {rank} your B computed weight gradients "
                      "(micro-batch {i}); they are W's work, later").format(
                          where=where, rank=rank, i=problem[1]),
                    _("ask autograd for the input's gradient only "
                      "(torch.autograd.grad(out, x, grad, retain_graph=True)) and "
                      "keep what W needs"))
            if problem and problem[0] == "x_grad":
                raise WrongAnswer(
                    _("{where}: on rank {rank} your B returned no gradient of x's "
                      "shape for micro-batch {i}; the previous stage waits for "
                      "it").format(where=where, rank=rank, i=problem[1]))
        truth, magnitude = _split_truth(hidden, depth, m, case_seed)
        got = [g for r in range(_SPLIT_RANKS) for g in ranks[r][c]["grads"]]
        for k, (g, t, a) in enumerate(zip(got, truth, magnitude)):
            if g is None:
                raise WrongAnswer(
                    _("{where}: a parameter has no gradient after the step; W adds "
                      "each micro-batch's weight gradients into .grad").format(
                          where=where))
            # the same products per micro-batch, summed in another order: at most
            # (m + 1) eps of the summed magnitudes, and a few eps of each term for
            # another kernel path to the same product
            bound = (m + 17) * eps * a + 1e-30
            if g.shape != t.shape or bool(((g - t).abs() > bound).any()):
                raise WrongAnswer(
                    _("{where}: the gradients after the step are not one process's "
                      "(largest difference {diff:.2e})").format(
                          where=where, diff=(g - t).abs().max().item()
                          if g.shape == t.shape else float("inf")),
                    _("W runs once per micro-batch and must add to .grad, never "
                      "replace it; B must keep the graph for W (retain_graph=True)"))
    passed(_("your B and W train every stage of ZB-H1 on three ranks as one process "
             "does, B leaving the weights to W, for {n} cases").format(n=len(cases)))
