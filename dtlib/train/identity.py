"""A checkpoint knows the run it belongs to, and a resume checks before it loads.

Every checkpoint of the capstone holds ``run.json``: the run's identity, what
:func:`run_identity` computes from the configuration and the data. Each entry has one
of three kinds (:data:`RULES`), the way torchtitan, Megatron-LM and DeepSpeed treat
them:

- **fixed**: what the saved tensors *are* (the model's shapes, the vocabulary, the
  data, the seed that ordered it, the tensor-parallel layout, the optimizer). A
  resume with another value is refused: loading would fail half-way, or worse,
  succeed and train another model on the old one's weights;
- **care**: what a run may change on purpose (the global batch, the learning-rate
  schedule, the number of steps, clipping, precision): refused unless
  ``--allow-change`` names it, then printed at start-up;
- **free**: how the run is executed (world size, strategy, micro-batch split,
  logging, kernels): printed once when it differs.

:func:`check_directory` is the first thing the trainer does once the ranks have
joined, before any model is built or file written: a
directory that holds another run's checkpoints, or a one-file checkpoint without an
identity, is refused with one message naming each differing field, both values and
the flag. Nothing in the directory is read beyond ``run.json`` files and directory
listings, and nothing is written.

Taught in: Chapter 10, "A checkpoint knows its run".
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

import dtlib
from dtlib.checkpoint.state import list_checkpoint_dirs, list_checkpoints, step_of
from dtlib.train.config import CARE_NAMES, OPTIMIZERS, TrainConfig
from dtlib.train.model import hf_config
from dtlib.train.tokens import TOKENS, read_meta

__all__ = ["IDENTITY", "RULES", "Refusal", "run_identity", "fingerprint", "compare",
           "Comparison", "check_directory", "read_identity", "step_dirs",
           "own_step_dirs", "data_fingerprint"]

#: The identity file inside every checkpoint directory (hashed in its manifest).
IDENTITY = "run.json"

#: identity key -> (kind, the flag that sets it). Every key of :func:`run_identity`.
RULES: dict[str, tuple[str, str]] = {
    "model": ("fixed", "--model"),
    "n_layers": ("fixed", "--n-layers"),
    "hidden": ("fixed", "--hidden"),
    "n_heads": ("fixed", "--n-heads"),
    "vocab_size": ("fixed", "--vocab-size"),
    "model_shape": ("fixed", "--model-config"),
    "seq_len": ("fixed", "--seq-len"),
    "data": ("fixed", "--data"),
    "seed": ("fixed", "--seed"),
    "tp": ("fixed", "--tp"),
    "optimizer": ("fixed", "--optimizer"),
    "low_comm": ("fixed", "--diloco / --powersgd / --powersgd-start"),
    "global_batch": ("care", "--micro-batch x --accum-steps x data-parallel ranks"),
    "lr": ("care", "--lr"),
    "warmup": ("care", "--warmup"),
    "min_lr_ratio": ("care", "--min-lr-ratio"),
    "steps": ("care", "--steps"),
    "weight_decay": ("care", "--weight-decay"),
    "grad_clip": ("care", "--grad-clip"),
    "precision": ("care", "--precision"),
    "strategy": ("free", "--strategy"),
    "world_size": ("free", "ranks"),
    "micro_batch": ("free", "--micro-batch"),
    "accum_steps": ("free", "--accum-steps"),
    "attention": ("free", "--attention"),
    "recompute": ("free", "--recompute"),
    "log_every": ("free", "--log-every"),
    "eval_every": ("free", "--eval-every"),
    "save_every": ("free", "--save-every"),
    "keep_last": ("free", "--keep-last"),
    "dtlib": ("free", "dtlib"),
    "torch": ("free", "torch"),
}
#: Entries added after checkpoints were first written, and the value that means what
#: a checkpoint without them did (its run used none of the entry's flags).
ADDED_LATER = {"low_comm": "none"}
#: ``--allow-change`` name -> its care entry (the name with underscores).
CARE_KEYS = {name: name.replace("-", "_") for name in CARE_NAMES}
assert {k for k, (kind, _) in RULES.items() if kind == "care"} \
    == set(CARE_KEYS.values())


class Refusal(Exception):
    """The run refuses to start: one message saying what differs and what to do.
    ``python -m dtlib.train`` prints it as an ``error:`` line and exits with 2."""


def data_fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """What identifies the training data: the synthetic corpus's size (its content
    follows from ``seed``, ``seq_len`` and ``vocab_size``), or the token file's
    metadata, its size in bytes, a SHA-256 of its first and last 64 KiB, and the
    held-out fraction (it decides which windows are trained on).

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    if cfg.data is None:
        return {"kind": "synthetic", "samples": cfg.dataset_size}

    meta = read_meta(cfg.data)
    path = os.path.join(cfg.data, TOKENS)
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        f.seek(max(0, size - (1 << 16)))
        h.update(f.read(1 << 16))
    return {"kind": "tokens", "meta": {k: meta[k] for k in sorted(meta)
                                       if k != "tokenizer" or meta[k] == "bytes"},
            "tokenizer": os.path.basename(os.path.normpath(str(meta["tokenizer"]))),
            "bytes": size, "ends_sha256": h.hexdigest()[:16],
            "eval_fraction": cfg.eval_fraction}


def _model_shape(cfg: TrainConfig) -> dict[str, Any] | None:
    """A Hugging Face model from a config file: the shape that file gives."""
    if cfg.model != "hf-llama" or not (cfg.model_config or cfg.init_from):
        return None

    config = hf_config(cfg)
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size",
            "tie_word_embeddings")
    return {k: getattr(config, k, None) for k in keys}


def run_identity(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """The identity of the run ``cfg`` describes on ``world_size`` ranks: one entry
    per key of :data:`RULES`, plain JSON values.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    dp = world_size // cfg.tp
    _, kwargs = OPTIMIZERS[cfg.optimizer]
    shape = _model_shape(cfg)
    ident = {
        "model": cfg.model, "n_layers": cfg.n_layers, "hidden": cfg.hidden,
        "n_heads": cfg.n_heads, "vocab_size": cfg.vocab_size, "model_shape": shape,
        "seq_len": cfg.seq_len, "data": data_fingerprint(cfg), "seed": cfg.seed,
        "tp": cfg.tp, "optimizer": {"name": cfg.optimizer, **kwargs},
        "global_batch": cfg.micro_batch * cfg.accum_steps * dp, "lr": cfg.lr,
        "warmup": cfg.warmup, "min_lr_ratio": cfg.min_lr_ratio, "steps": cfg.steps,
        "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip,
        "precision": cfg.precision, "strategy": cfg.strategy,
        "world_size": world_size, "micro_batch": cfg.micro_batch,
        "accum_steps": cfg.accum_steps, "attention": cfg.attention,
        "recompute": cfg.recompute, "log_every": cfg.log_every,
        "eval_every": cfg.eval_every, "save_every": cfg.save_every,
        "keep_last": cfg.keep_last, "dtlib": dtlib.__version__,
        "low_comm": ({"diloco": cfg.diloco} if cfg.diloco else
                     {"powersgd": cfg.powersgd, "start": cfg.powersgd_start}
                     if cfg.powersgd else "none"),
        "torch": torch.__version__.split("+")[0],
    }
    if shape is not None:  # the file's shape replaces the size flags
        for key in ("n_layers", "hidden", "n_heads", "vocab_size"):
            ident[key] = None
    return json.loads(json.dumps(ident))  # as run.json will hold it


def fingerprint(identity: dict[str, Any]) -> str:
    """A short SHA-256 of the fixed entries: equal for every checkpoint, log and
    resume of one run.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    fixed = {k: identity.get(k, ADDED_LATER.get(k)) for k, (kind, _) in RULES.items()
             if kind == "fixed"}
    fixed = {k: v for k, v in fixed.items()  # as a checkpoint without them hashed
             if not (k in ADDED_LATER and v == ADDED_LATER[k])}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def _show(key: str, value: Any) -> str:
    """``--hidden 64``, ``a global batch of 8 sequences``, the data in words."""
    flag = RULES[key][1]
    if key == "global_batch":
        return f"a global batch of {value} sequences ({flag})"
    if key == "world_size":
        return f"{value} ranks"
    if key in ("dtlib", "torch"):
        return f"{key} {value}"
    if key == "optimizer":
        extra = ", ".join(f"{k} {v}" for k, v in value.items() if k != "name")
        return f"--optimizer {value['name']}" + (f" ({extra})" if extra else "")
    if key == "data":
        if value["kind"] == "synthetic":
            return f"the synthetic corpus of --dataset-size {value['samples']}"
        meta = value["meta"]
        return (f"--data of {meta['n_tokens']} tokens (tokens.bin of {value['bytes']} "
                f"bytes, vocabulary {meta['vocab_size']}, tokenizer "
                f"{value['tokenizer']}, --eval-fraction {value['eval_fraction']})")
    if key == "model_shape":
        return ("a model of the size flags" if value is None else
                "a model of " + ", ".join(f"{k} {v}" for k, v in value.items()))
    if value is None:
        return f"{flag} (from --model-config)"
    return f"{flag} {value}"


@dataclass
class Comparison:
    """A saved identity against this run's, entry by entry.

    fixed, care, free: ``(key, saved, now)`` of each differing entry, by kind.
    allowed: the care keys ``--allow-change`` names.
    """

    fixed: list[tuple[str, Any, Any]] = field(default_factory=list)
    care: list[tuple[str, Any, Any]] = field(default_factory=list)
    free: list[tuple[str, Any, Any]] = field(default_factory=list)
    allowed: frozenset[str] = frozenset()

    @property
    def unallowed(self) -> list[tuple[str, Any, Any]]:
        """The care entries that differ without ``--allow-change``."""
        return [c for c in self.care if c[0] not in self.allowed]

    def refusal(self, path: str) -> str | None:
        """The message refusing to resume from ``path``, or None when it may."""
        if self.fixed:
            diffs = "; ".join(f"{path} was written with {_show(k, a)}; this run has "
                              f"{_show(k, b)}" for k, a, b in self.fixed)
            return (f"{diffs}. These are what the checkpoint's tensors are: resume "
                    "with the checkpoint's values, or start a new run in another "
                    "--ckpt-dir (nothing was loaded, nothing in it changed)")
        if self.unallowed:
            diffs = "; ".join(f"{path} was written with {_show(k, a)}; this run has "
                              f"{_show(k, b)}" for k, a, b in self.unallowed)
            names = ",".join(n for n, k in CARE_KEYS.items()
                             if k in {c[0] for c in self.unallowed})
            return (f"{diffs}. To continue with the new value from step "
                    f"{step_of(path)} on, pass --allow-change {names}; to continue "
                    "the run as it was, resume with the checkpoint's value "
                    "(nothing was loaded, nothing in it changed)")
        return None

    def lines(self) -> list[str]:
        """What differs and is allowed, one line each, for the start-up report."""
        out = [f"changed with --allow-change: {_show(k, a)} -> {_show(k, b)}"
               for k, a, b in self.care]
        free = [f"{_show(k, a)} -> {_show(k, b)}" for k, a, b in self.free]
        if free:
            out.append("not part of the run's identity, changed: " + "; ".join(free))
        return out


def compare(saved: dict[str, Any], now: dict[str, Any],
            allowed: frozenset[str] = frozenset()) -> Comparison:
    """Entry by entry, ``saved`` against ``now`` (both :func:`run_identity`'s):
    an entry a saved identity lacks counts as differing, unless it came later
    (:data:`ADDED_LATER`) and this run has its old behaviour.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    out = Comparison(allowed=frozenset(CARE_KEYS[n] for n in allowed))
    for key, (kind, _) in RULES.items():
        a, b = saved.get(key, ADDED_LATER.get(key, "(not recorded)")), now.get(key)
        if a != b:
            getattr(out, kind).append((key, a, b))
    return out


def step_dirs(ckpt_dir: str) -> list[str]:
    """The published checkpoints of ``ckpt_dir`` (``stepNNNNNNNN``), newest first.

    Taught in: Chapter 10, "Crash and resume".
    """
    return [path for _, path in reversed(list_checkpoint_dirs(ckpt_dir))]


def read_identity(path: str) -> dict[str, Any] | None:
    """``path/run.json``, or None when it is missing or unreadable (then the
    checkpoint is damaged, or not a checkpoint of this script).

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    try:
        with open(os.path.join(path, IDENTITY)) as f:
            ident = json.load(f)
    except (OSError, ValueError):
        return None
    return ident if isinstance(ident, dict) else None


def own_step_dirs(ckpt_dir: str, identity: dict[str, Any]) -> list[str]:
    """The checkpoints of ``ckpt_dir`` whose ``run.json`` has this run's fixed
    entries, newest first: the only ones ``--keep-last`` may delete.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    mine = fingerprint(identity)
    return [p for p in step_dirs(ckpt_dir)
            if (saved := read_identity(p)) is not None and fingerprint(saved) == mine]


def _writable(path: str) -> str | None:
    """Why ``path`` (a directory to create or write into) cannot be written, or
    None."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is a file"
    try:  # what the file system says, for root too (a read-only mount)
        fd, name = tempfile.mkstemp(dir=probe, prefix=".dtlib-write-test-")
    except OSError as exc:
        return f"{probe}: {exc.strerror or exc}"
    os.close(fd)
    os.remove(name)  # the probe is the only file this check creates
    return None


def check_directory(cfg: TrainConfig, world_size: int) -> Comparison | None:
    """Before anything is built or written: may this run write to ``cfg.ckpt_dir``
    (and ``cfg.log_file``), and resume what is there? It reads directory listings
    and ``run.json`` files only, the same on every rank.

    Refused: an unwritable directory; a one-file checkpoint (``stepNNNNNNNN.pt``,
    no identity); a checkpoint of another run (a fixed entry differs), with or
    without ``--fresh``; a care entry changed without ``--allow-change``,
    compared with the newest checkpoint whose identity reads back; a log file
    that another run wrote.

    Returns:
        The comparison with that newest checkpoint (None: nothing to resume).
    Raises:
        Refusal: the one message naming what differs.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    now = run_identity(cfg, world_size)
    found = _check_checkpoints(cfg, now)
    log = cfg.log_file or (os.path.join(cfg.ckpt_dir, "train_log.jsonl")
                           if cfg.ckpt_dir else None)
    if log is not None:
        check_log(log, now)
    return found


def _check_checkpoints(cfg: TrainConfig, now: dict[str, Any]) -> Comparison | None:
    if cfg.ckpt_dir is None:
        return None
    why = _writable(cfg.ckpt_dir)
    if why:
        raise Refusal(f"--ckpt-dir {cfg.ckpt_dir} cannot be written ({why}); allowed: "
                      "a directory this user may create or write into")
    if not os.path.isdir(cfg.ckpt_dir):
        return None
    legacy = [path for _, path in list_checkpoints(cfg.ckpt_dir)]
    if legacy:
        raise Refusal(f"{legacy[-1]} is a one-file "
                      f"checkpoint with no run identity ({len(legacy)} such in "
                      f"{cfg.ckpt_dir}): it cannot be told apart from another run's; "
                      "start this run in another --ckpt-dir (nothing there changed)")
    newest = None
    for path in step_dirs(cfg.ckpt_dir):
        saved = read_identity(path)
        if saved is None:
            continue  # damaged: the resume hashes it and falls back
        found = compare(saved, now, frozenset(cfg.allow_change_names))
        message = found.refusal(path) if found.fixed or newest is None else None
        if message is not None and (found.fixed or not cfg.fresh):
            raise Refusal(message)
        newest = newest or found
    return newest


def check_log(path: str, now: dict[str, Any]) -> None:
    """Refuse a JSON-lines log that another run wrote (its first record's
    ``run`` fingerprint differs, or it has none): the run appends to its own log
    only.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    try:
        with open(path) as f:
            first = json.loads(f.readline())
        owner = first.get("run") if isinstance(first, dict) else None
    except (OSError, ValueError):
        owner = None
    if owner != fingerprint(now):
        raise Refusal(f"{path} is the log of another run (run {owner or 'unknown'}; "
                      f"this run is {fingerprint(now)}); it is appended to only by "
                      "its own run: give --log-file another path (nothing changed)")
