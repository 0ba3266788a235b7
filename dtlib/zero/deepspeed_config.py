"""DeepSpeed configurations: build one from a few arguments, and check one.

DeepSpeed reads a JSON dict; it derives what is missing of ``train_batch_size``,
``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` from
``train_batch_size = micro_batch * accum_steps * world_size``, and refuses a config
where the three disagree, but only once the job has started on all its GPUs. The checks
here run anywhere, without DeepSpeed installed, and say what is wrong in words.

Taught in: Chapter 4, "The seed's DeepSpeed config".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from dtlib.zero.deepspeed_keys import SNAPSHOT, KeyLists, deepspeed_keys

#: The key lists of DeepSpeed SNAPSHOT_VERSION (the validator reads the installed
#: DeepSpeed's own when there is one: :func:`dtlib.zero.deepspeed_keys.deepspeed_keys`).
TOP_LEVEL_KEYS = SNAPSHOT.top
ZERO_KEYS = SNAPSHOT.zero
OFFLOAD_KEYS = SNAPSHOT.offload_param | SNAPSHOT.offload_optimizer
PRECISIONS = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class DeepSpeedCheck:
    """A config that passed :func:`validate_deepspeed_config`, resolved.

    world_size: the world it was checked for.
    micro_batch: samples per GPU per forward (``train_micro_batch_size_per_gpu``).
    accum_steps: ``gradient_accumulation_steps``.
    train_batch_size: samples per optimizer step, all GPUs together.
    zero_stage: 0-3.
    precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
    notes: advice that is not an error (e.g. fp16 where bf16 is safer).
    """

    world_size: int
    micro_batch: int
    accum_steps: int
    train_batch_size: int
    zero_stage: int
    precision: str
    notes: list[str] = field(default_factory=list)


def deepspeed_config(*, micro_batch: int, accum_steps: int = 1, world_size: int = 1,
                     zero_stage: int = 2, precision: str = "bf16",
                     offload_optimizer: bool = False, offload_param: bool = False,
                     lr: float = 3e-4, weight_decay: float = 0.1,
                     betas: tuple[float, float] = (0.9, 0.95),
                     grad_clip: float = 1.0) -> dict[str, Any]:
    """A consistent DeepSpeed config for AdamW with ZeRO.

    Args:
        micro_batch: samples per GPU per forward.
        accum_steps: micro-batches accumulated per optimizer step.
        world_size: data-parallel GPUs; ``train_batch_size`` is computed from it.
        zero_stage: 0, 1, 2 or 3.
        precision: ``"bf16"`` (the default on GPUs that have it), ``"fp16"`` (dynamic
            loss scaling) or ``"fp32"``.
        offload_optimizer: keep optimizer states on the CPU (ZeRO-Offload).
        offload_param: keep parameters on the CPU (needs stage 3).
        lr, weight_decay, betas: AdamW's hyper-parameters.
        grad_clip: global gradient-norm clip.
    Returns:
        The config dict; :func:`validate_deepspeed_config` accepts it for
        ``world_size``.

    Taught in: Chapter 4, "The seed's DeepSpeed config".
    """
    for name, value in (("micro_batch", micro_batch), ("accum_steps", accum_steps),
                        ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} not allowed; allowed: {PRECISIONS}")
    cfg: dict[str, Any] = {
        "train_batch_size": micro_batch * accum_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accum_steps,
        "gradient_clipping": grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": lr, "betas": list(betas), "eps": 1e-8, "weight_decay": weight_decay}},
        "zero_optimization": {"stage": zero_stage, "overlap_comm": True,
                              "contiguous_gradients": True},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu",
                                                         "pin_memory": True}
    if offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu",
                                                     "pin_memory": True}
    validate_deepspeed_config(cfg, world_size)
    return cfg


#: Where this validator is deliberately stricter than DeepSpeed (Chapter 4 lists
#: them): marker in our message -> why. DeepSpeed accepts these configs.
STRICTER = {
    "unknown key ": "DeepSpeed ignores unknown top-level keys (a typo such as "
                    "'gradient_clip' silently keeps the default); we name them",
    "needs stage 3": "DeepSpeed accepts offload_param below stage 3 and never "
                     "offloads the parameters; we say so",
    "needs ZeRO stage 1, 2 or 3": "DeepSpeed accepts offload_optimizer at stage 0 "
                                  "and never offloads; we say so",
    "needs nvme_path": "DeepSpeed accepts device 'nvme' without a path and fails "
                       "only when it first swaps; we fail before the job starts",
}


def _unknown(keys: Any, known: frozenset, where: str,
             removed: dict[str, str] | None = None) -> list[str]:
    errors = []
    for key in keys:
        if removed and f"{where}{key}" in removed:
            errors.append(f"{where}{key!r} was removed from DeepSpeed: "
                          f"{removed[where + key]}")
        elif key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"unknown key {where}{key!r}{hint}")
    return errors


def _resolve_batch(cfg: dict[str, Any], world_size: int,
                   errors: list[str]) -> tuple[int, int, int]:
    tbs = cfg.get("train_batch_size")
    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps")
    for name, value in (("train_batch_size", tbs),
                        ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accum)):
        if value is not None and (not isinstance(value, int) or value < 1):
            errors.append(f"{name}={value!r} must be a positive integer")
            return 0, 0, 0
    if tbs is None and micro is None:
        errors.append("set train_batch_size or train_micro_batch_size_per_gpu")
        return 0, 0, 0
    if tbs is None:
        accum = accum or 1
        return micro * accum * world_size, micro, accum
    if micro is None:
        accum = accum or 1
        if tbs % (accum * world_size):
            errors.append(
                f"train_batch_size={tbs} is not divisible by "
                f"gradient_accumulation_steps x world_size = {accum} x {world_size} = "
                f"{accum * world_size}: no integer micro-batch per GPU exists")
            return tbs, 0, accum
        return tbs, tbs // (accum * world_size), accum
    if accum is None:
        if tbs % (micro * world_size):
            errors.append(f"train_batch_size={tbs} is not divisible by micro_batch x "
                          f"world_size = {micro} x {world_size}")
            return tbs, micro, 0
        return tbs, micro, tbs // (micro * world_size)
    if tbs != micro * accum * world_size:
        errors.append(
            f"train_batch_size={tbs} != train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world_size = {micro} x {accum} x "
            f"{world_size} = {micro * accum * world_size}")
    return tbs, micro, accum


def validate_deepspeed_config(cfg: dict[str, Any], world_size: int,
                              keys: str | KeyLists = "auto") -> DeepSpeedCheck:
    """Check a DeepSpeed config for ``world_size`` data-parallel GPUs.

    Catches: batch sizes that disagree (``train_batch_size`` must equal micro-batch x
    accumulation steps x world size), fp16 and bf16 both enabled, parameter offload
    without stage 3 (optimizer offload without ZeRO), keys DeepSpeed removed (``amp``,
    ``mics_shard_size``) and unknown keys. Where it is stricter than DeepSpeed on
    purpose, :data:`STRICTER` says so.

    Args:
        cfg: the config dict (as loaded from the JSON file).
        world_size: number of data-parallel GPUs the job will run on.
        keys: the key lists: ``"auto"`` (the installed DeepSpeed's, else the stored
            snapshot), ``"installed"``, ``"snapshot"``, or a :class:`KeyLists`.
    Returns:
        The resolved :class:`DeepSpeedCheck`.
    Raises:
        ValueError: one line per problem found.

    Taught in: Chapter 4, "The seed's DeepSpeed config".
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) \
            or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if not isinstance(cfg, dict):
        raise ValueError(f"cfg must be a dict, got {type(cfg).__name__}")
    known = keys if isinstance(keys, KeyLists) else deepspeed_keys(keys)
    errors = _unknown(cfg, known.top, "", known.removed)
    tbs, micro, accum = _resolve_batch(cfg, world_size, errors)
    zero = cfg.get("zero_optimization", {}) or {}
    errors += _unknown(zero, known.zero, "zero_optimization.", known.removed)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        errors.append(f"zero_optimization.stage={stage!r} not allowed; allowed: 0-3")
    fp16 = bool((cfg.get("fp16") or {}).get("enabled", False))
    bf16 = bool((cfg.get("bf16") or {}).get("enabled", False))
    if fp16 and bf16:
        errors.append("fp16.enabled and bf16.enabled are both true: choose one "
                      "(bf16 where the GPU supports it)")
    for key, need in (("offload_param", 3), ("offload_optimizer", 1)):
        off = zero.get(key)
        if not off:
            continue
        allowed = known.offload_param if key == "offload_param" \
            else known.offload_optimizer
        errors += _unknown(off, allowed, f"zero_optimization.{key}.")
        device = off.get("device", "none")
        if device not in ("cpu", "nvme", "none"):
            errors.append(f"zero_optimization.{key}.device={device!r} not allowed; "
                          "allowed: 'cpu', 'nvme', 'none'")
        if device == "nvme" and not off.get("nvme_path"):
            errors.append(f"zero_optimization.{key}.device='nvme' needs nvme_path")
        if device != "none" and isinstance(stage, int) and stage < need:
            what = "stage 3" if need == 3 else "ZeRO stage 1, 2 or 3"
            errors.append(f"zero_optimization.{key} needs {what}; stage={stage}")
    if errors:
        raise ValueError(f"invalid DeepSpeed config for world_size={world_size}:\n  "
                         + "\n  ".join(errors))
    notes = []
    if fp16:
        notes.append("fp16 needs dynamic loss scaling and can overflow; on GPUs with "
                     "bf16 (A100, H100) bf16 is the safer default")
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    return DeepSpeedCheck(world_size, micro, accum, tbs, stage, precision, notes)


def consistent_world_sizes(cfg: dict[str, Any], max_world_size: int = 256
                           ) -> list[int]:
    """World sizes ``1..max_world_size`` for which ``cfg`` validates.

    Taught in: Chapter 4, "The seed's DeepSpeed config" (ERRATA 12).
    """
    ok = []
    for n in range(1, max_world_size + 1):
        try:
            validate_deepspeed_config(cfg, n)
        except ValueError:
            continue
        ok.append(n)
    return ok
