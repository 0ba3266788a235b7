"""Checkers for Chapter 1, "Memory math"."""

from __future__ import annotations

from dtlib.exercises import WrongAnswer, check_close, checker, passed
from dtlib.memory.formulas import GB, TrainingConfig, estimate, model_state_bytes

# The model of the third exercise: a 13B-class GPT trained on 64 data-parallel GPUs.
FIT_MODEL = dict(n_layers=40, hidden=5120, n_heads=40, vocab_size=50257,
                 seq_len=2048, micro_batch=1, dp=64)
STAGES = (0, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")


_BYTES_HINT = ("list every copy a parameter has during a mixed-precision Adam step "
               "(weights, gradient, what the optimizer keeps) with its dtype; "
               "'The corrected accounting' names them")


@checker
def check_bytes_per_param(answer: float) -> None:
    """Bytes per parameter of mixed-precision Adam (params + grads + optimizer)."""
    hints = {10: "that is the seed's mistake: every copy in the 16-bit dtype. The "
                 "optimizer keeps an fp32 master copy and both moments in fp32.",
             12: "12 is K, the optimizer state alone (master copy and moments). "
                 "What else does each parameter keep in memory while it trains?",
             14: "one 16-bit copy is missing: what does backward() write for each "
                 "parameter?",
             8: "8 bytes are Adam's two fp32 moments; the optimizer keeps more, and "
                "so does the model itself."}
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) \
            and answer in hints:
        raise WrongAnswer(f"bytes per parameter: got {answer!r}; " + hints[answer],
                          _BYTES_HINT)
    check_close("bytes per parameter", answer, 16.0, hint=_BYTES_HINT)
    passed("mixed-precision Adam holds 2 + 2 + 12 = 16 bytes per parameter")


@checker
def check_zero2_gb(n_params: float, dp: int, answer_gb: float) -> None:
    """Per-device model-state memory in GB (1e9 B) under ZeRO-2 (P_os+g)."""
    truth = {s: model_state_bytes(n_params, zero_stage=s, dp=dp).total / GB
             for s in STAGES}
    for s, name in ((0, "plain data parallelism"), (1, "ZeRO-1"), (3, "ZeRO-3")):
        if isinstance(answer_gb, (int, float)) and not isinstance(answer_gb, bool) \
                and abs(answer_gb - truth[s]) <= 1e-3 * truth[s] \
                and abs(truth[s] - truth[2]) > 1e-3 * truth[2]:
            raise WrongAnswer(
                f"ZeRO-2 memory: {answer_gb!r} GB is the {name} figure. ZeRO-2 "
                "partitions the optimizer state and the gradients, not the params.")
    check_close("ZeRO-2 memory (GB)", answer_gb, truth[2], rel=1e-3,
                hint="which of the three model states does ZeRO-2 split over the N_d "
                     "ranks, and which stays whole on every rank? ('ZeRO: sharding the "
                     "model states'; GB = 1e9 bytes)")
    passed(f"ZeRO-2 holds {truth[2]:.2f} GB per device for Psi={n_params:.3g}, "
           f"N_d={dp}")


def fitting_combinations(device_gb: float = 80.0) -> set[tuple[int, str]]:
    """Every (zero_stage, recompute) for which ``FIT_MODEL`` fits ``device_gb``."""
    return {(s, r) for s in STAGES for r in RECOMPUTES
            if estimate(TrainingConfig(**FIT_MODEL, zero_stage=s, recompute=r))
            .fits(device_gb)}


@checker
def check_fitting_combinations(answer, device_gb: float = 80.0) -> None:
    """``answer``: the set of (zero_stage, recompute) pairs that fit on the device."""
    try:
        got = {(int(s), str(r)) for s, r in answer}
    except (TypeError, ValueError):
        raise WrongAnswer(f"expected a set of (zero_stage, recompute) pairs such as "
                          f"{{(3, 'full')}}, got {answer!r}") from None
    bad = [p for p in got if p[0] not in STAGES or p[1] not in RECOMPUTES]
    if bad:
        raise WrongAnswer(f"unknown pairs {sorted(bad)}: stages are {STAGES}, "
                          f"recompute is one of {RECOMPUTES}")
    truth = fitting_combinations(device_gb)

    def gb(pair):
        e = estimate(TrainingConfig(**FIT_MODEL, zero_stage=pair[0], recompute=pair[1]))
        return f"{pair}: {e.model_states / GB:.1f} GB states + " \
               f"{e.activations / GB:.1f} GB activations"

    extra, missing = sorted(got - truth), sorted(truth - got)
    if extra:
        raise WrongAnswer(f"these do not fit on {device_gb:g} GB: "
                          + "; ".join(gb(p) for p in extra))
    if missing:
        raise WrongAnswer(f"you left out {len(missing)} pair(s) that fit, e.g. "
                          f"{gb(missing[0])}. Hint: check every stage with every "
                          "recompute choice.")
    passed(f"{len(truth)} of the 12 combinations fit on {device_gb:g} GB")
