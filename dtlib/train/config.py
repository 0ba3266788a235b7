"""The capstone's configuration: one typed dataclass, one flag per field.

Every knob of :mod:`dtlib.train` is a field of :class:`TrainConfig` with a docstring
line and a check in ``__post_init__``: a bad value stops the job before any process
group, model or file exists, with a message that names the flag, the value and what is
allowed. :func:`parse_args` maps the command line onto it (``--accum-steps`` ->
``accum_steps``), so the flags and the fields cannot drift apart.

Taught in: Chapter 10, "The script's structure".
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import MISSING, dataclass, fields
from typing import Sequence

from dtlib.models.optimizers import OPTIMIZERS
from dtlib.runtime.i18n import _
from dtlib.train.data import TokenWindows, held_out_split
from dtlib.train.tokens import open_tokens

#: ``--strategy``: the capstone's rows of the one strategy table
#: (:func:`dtlib.planner.strategies.capstone_names`; a test checks they agree).
STRATEGY_NAMES = ("ddp", "fsdp")
MODELS = ("gpt", "hf-llama")
#: ``--optimizer``: the book's one table (class, arguments besides lr and
#: weight_decay).
OPTIMIZER_NAMES = tuple(OPTIMIZERS)
PRECISIONS = ("fp32", "bf16", "fp16")
#: ``--attention`` (``dtlib.models.gpt.ATTENTION``) and ``--recompute``
#: (``dtlib.memory.recompute.RECOMPUTE_MODES``); tests check they agree.
ATTENTION = ("explicit", "sdpa")
RECOMPUTE = ("none", "selective", "full")
#: ``--allow-change``: the entries of a run's identity that a resume may change on
#: purpose (:data:`dtlib.train.identity.RULES`' "care" entries).
CARE_NAMES = ("global-batch", "lr", "warmup", "min-lr-ratio", "steps", "weight-decay",
              "grad-clip", "precision")
#: The choices of each string flag that has a fixed set (shown by ``--help``).
CHOICES = {"strategy": STRATEGY_NAMES, "precision": PRECISIONS, "model": MODELS,
           "optimizer": OPTIMIZER_NAMES, "attention": ATTENTION, "recompute": RECOMPUTE}
#: The convention of every count and interval, stated once in ``--help``.
ZERO_TURNS_OFF = (
    "A count or interval of 0 turns its feature off: --save-every 0 saves only after "
    "the last step and on preemption, --keep-last 0 deletes no checkpoint, "
    "--log-every 0 logs only the last step, --eval-every 0 never evaluates, "
    "--stop-after 0 and --kill-at-step 0 never stop, --grad-clip 0 never clips.")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on.

    strategy: "ddp" (replicated model, gradient all-reduce) or "fsdp" (FSDP2
        ``fully_shard``: parameters, gradients and optimizer state sharded, ZeRO-3).
    precision: "fp32"; "bf16" (autocast under DDP, a bf16 MixedPrecisionPolicy under
        FSDP; no loss scaler); "fp16" (autocast plus GradScaler, DDP only).
    model: "gpt" (the book's GPT) or "hf-llama" (transformers' LlamaForCausalLM
        from a LlamaConfig of the size flags below, random weights; needs the .[hf]
        extra; nothing is downloaded).
    model_config: hf-llama only: a local config.json (or model directory) whose
        shape replaces the size flags.
    init_from: hf-llama only: a local save_pretrained directory whose weights
        (and config) start the run instead of random ones.
    n_layers: transformer blocks (decoder layers).
    hidden: model width; divisible by n_heads.
    n_heads: attention heads.
    seq_len: tokens per sample.
    vocab_size: tokens in the vocabulary.
    micro_batch: samples per rank per forward/backward.
    accum_steps: micro-batches per optimizer step (no_sync on all but the last).
    steps: optimizer steps of the whole run (a resumed run counts from its checkpoint).
    optimizer: "adamw" (AdamW at torch's betas and eps) or "sgd" (SGD with momentum
        0.9: its step is smooth in the gradient, so equal gradients give equal
        trajectories; the tests' proofs use it).
    lr: peak learning rate, reached after ``warmup`` steps.
    warmup: steps of linear warm-up; then cosine decay to ``min_lr_ratio * lr``
        (default: 2, or steps - 1 when steps <= 2).
    min_lr_ratio: the final learning rate as a fraction of ``lr``.
    weight_decay: the optimizer's weight decay (AdamW's is decoupled).
    grad_clip: clip the global gradient norm to this (0 turns clipping off).
    dataset_size: samples in the synthetic dataset (an epoch).
    seed: seeds the model's weights, the data and the sampler's shuffling.
    ckpt_dir: directory of checkpoints; None saves nothing and resumes nothing. A
        run resumes the newest good checkpoint there; one of another run (another
        model, data, seed, tp or optimizer) is refused, naming what differs.
    save_every: save after every this many steps (and after the last step).
    log_every: rank 0 prints step, loss, learning rate and tokens/s this often.
    stop_after: leave after this many steps of *this* process without a final save,
        as a crash would (0: run to ``steps``).
    summary_json: rank 0 writes the run's losses and a parameter digest here.
    loss_scale: fp16 only: the loss scaler's first scale (GradScaler's init_scale).
    tp: tensor-parallel degree (fsdp and the GPT only): a (dp, tp) device mesh,
        DTensor TP inside each group of tp ranks, FSDP2 across dp; divides the
        world size and n_heads (1: no tensor parallelism).
    data: a directory written by ``python -m dtlib.train.data prepare``: train on
        its memory-mapped token file instead of the synthetic corpus (vocab_size
        must cover the file's vocabulary; dataset_size is then unused).
    eval_fraction: data only: the last fraction of the token file held out for
        evaluation (0: none).
    eval_every: every this many steps, the mean loss on the held-out samples (0:
        never); the synthetic corpus holds out eval_samples of another seed.
    eval_samples: held-out samples per evaluation (the first ones, the same on any
        world size).
    log_file: rank 0 appends one JSON line per logged step and per evaluation
        here (default: train_log.jsonl in ckpt_dir when there is one).
    peak_flops: one device's peak FLOP/s for MFU (0: a matmul measured at start-up).
    keep_last: after each save, delete all but this many newest checkpoints of
        this run (0: keep every one; another run's are never deleted).
    kill_at_step: a rehearsal of a dead rank: the last rank SIGKILLs itself in the
        middle of this step, in torchrun's first attempt only (0: never).
    attention: "explicit" (the s x s scores written out; HF: "eager") or "sdpa"
        (``scaled_dot_product_attention``: no s x s tensor stored; Chapter 12).
    recompute: "none", "selective" (the attention core; GPT only) or "full" (each
        block, HF: gradient checkpointing) recomputed in backward (Chapter 12).
    config: a TOML file whose keys are these flags (``accum-steps = 2``); flags on
        the command line override it.
    export_hf: hf-llama only: after training, rank 0 writes the full model here
        with ``save_pretrained`` (``from_pretrained`` loads it).
    async_save: save in the background: the loop waits only while the state is
        copied to CPU memory; a thread writes it (``dcp.async_save`` for sharded
        checkpoints) and the next save, or the end of the run, waits for it.
    tensorboard: also write the logged scalars as TensorBoard events to this
        directory (needs the .[tensorboard] extra; without it the run says so in
        one line and continues).
    fresh: start from step 0 although ckpt_dir holds checkpoints of this run
        (all damaged, or a deliberate restart); they are moved, untouched, into
        ckpt_dir/superseded-N/ first. Another run's checkpoints are still refused.
    allow_change: comma-separated identity entries a resume may change:
        global-batch, lr, warmup, min-lr-ratio, steps, weight-decay, grad-clip,
        precision (printed at start-up; without it a change is refused).
    diloco: DiLoCo (Chapter 15): every data-parallel rank a replica that takes this
        many steps of the optimizer alone, then an outer step: the replicas'
        pseudo-gradients averaged in one all-reduce, the shared anchor stepped by
        Nesterov SGD (lr 0.7, momentum 0.9), every replica back at it. Strategy ddp
        only; a checkpoint holds every replica, the anchor and both optimizers, and
        resumes on the same number of ranks (0: off, plain DDP).
    powersgd: PowerSGD (Chapter 15): DDP all-reduces its gradients as rank-this
        factors, with error feedback and warm start (torch DDP's communication
        hook). Strategy ddp only; a checkpoint holds each rank's error and factors,
        and resumes on the same number of ranks (0: off).
    powersgd_start: powersgd only: plain all-reduces for the first this many steps
        (at least 2: torch DDP regroups its buckets after the first step).
    shutdown_timeout: seconds a preemption save may take: torchrun's
        --shutdown-timeout (torchrun SIGKILLs the workers after it; default:
        $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else torchrun's 30). The run says at
        start-up and after each save whether a save fits.
    """

    strategy: str = "ddp"
    precision: str = "fp32"
    model: str = "gpt"
    model_config: str | None = None
    init_from: str | None = None
    n_layers: int = 2
    hidden: int = 64
    n_heads: int = 4
    seq_len: int = 32
    vocab_size: int = 64
    micro_batch: int = 4
    accum_steps: int = 1
    steps: int = 20
    optimizer: str = "adamw"
    lr: float = 3e-3
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    dataset_size: int = 1024
    seed: int = 0
    ckpt_dir: str | None = None
    save_every: int = 5
    log_every: int = 5
    stop_after: int = 0
    summary_json: str | None = None
    loss_scale: float = 65536.0
    tp: int = 1
    data: str | None = None
    eval_fraction: float = 0.05
    eval_every: int = 0
    eval_samples: int = 32
    log_file: str | None = None
    peak_flops: float = 0.0
    keep_last: int = 0
    kill_at_step: int = 0
    attention: str = "explicit"
    recompute: str = "none"
    config: str | None = None
    export_hf: str | None = None
    async_save: bool = False
    tensorboard: str | None = None
    fresh: bool = False
    allow_change: str = ""
    diloco: int = 0
    powersgd: int = 0
    powersgd_start: int = 10
    shutdown_timeout: float = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                                                   "30"))

    def __post_init__(self) -> None:
        if self.warmup is None and isinstance(self.steps, int) and self.steps >= 1:
            object.__setattr__(self, "warmup", min(2, self.steps - 1))
        for name in ("fresh", "async_save"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(_("{name}={value!r} must be True or False").format(
                    name=name, value=getattr(self, name)))
        unknown = [n for n in self.allow_change_names if n not in CARE_NAMES]
        if unknown or not isinstance(self.allow_change, str):
            raise ValueError(_("allow_change={value!r} names {unknown}; allowed: a "
                               "comma-separated list of {names}").format(
                value=self.allow_change, unknown=", ".join(map(repr, unknown)),
                names=", ".join(CARE_NAMES)))
        if not 0 < self.shutdown_timeout < math.inf:
            raise ValueError(_("{name}={value!r} must be finite and > 0").format(
                name="shutdown_timeout", value=self.shutdown_timeout))
        _choice("strategy", self.strategy, STRATEGY_NAMES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("model", self.model, MODELS)
        _choice("optimizer", self.optimizer, OPTIMIZER_NAMES)
        _choice("attention", self.attention, ATTENTION)
        _choice("recompute", self.recompute, RECOMPUTE)
        if self.tensorboard is not None and os.path.isfile(self.tensorboard):
            raise ValueError(_("{name}={value!r} is a file; allowed: a directory (it "
                               "is created if missing)").format(
                name="tensorboard", value=self.tensorboard))
        if self.recompute == "selective" and self.model != "gpt":
            raise ValueError(_("recompute='selective' is implemented for model='gpt' "
                               "only, not model={model!r}; allowed: none, full").format(
                model=self.model))
        if self.export_hf is not None and self.model != "hf-llama":
            raise ValueError(_("{name}={value!r} needs model='hf-llama', not "
                               "model={model!r}").format(
                name="export_hf", value=self.export_hf, model=self.model))
        for name in ("model_config", "init_from"):
            if getattr(self, name) is not None and self.model != "hf-llama":
                raise ValueError(_("{name}={value!r} needs model='hf-llama', not "
                                   "model={model!r}").format(
                    name=name, value=getattr(self, name), model=self.model))
        if self.model_config is not None and self.init_from is not None:
            raise ValueError(_("model_config and init_from are both set; allowed: "
                               "one (init_from's directory holds its own "
                               "config.json)"))
        for name in ("n_layers", "hidden", "n_heads", "seq_len", "vocab_size",
                     "micro_batch", "accum_steps", "steps", "dataset_size",
                     "eval_samples"):
            _int(name, getattr(self, name), minimum=1)
        for name in ("warmup", "seed", "stop_after", "eval_every", "keep_last",
                     "kill_at_step", "save_every", "log_every"):
            _int(name, getattr(self, name), minimum=0)
        if self.hidden % self.n_heads:
            raise ValueError(_("hidden={hidden} must be divisible by n_heads={heads}; "
                               "allowed: a multiple of it").format(
                hidden=self.hidden, heads=self.n_heads))
        for name in ("lr", "loss_scale"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(_("{name}={value!r} must be finite and > 0").format(
                    name=name, value=getattr(self, name)))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(_("{name}={value!r} must be in {interval}").format(
                name="min_lr_ratio", value=self.min_lr_ratio, interval="[0, 1]"))
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(_("{name}={value!r} must be in {interval}").format(
                name="eval_fraction", value=self.eval_fraction, interval="[0, 1)"))
        if self.data is not None and not os.path.isdir(self.data):
            raise ValueError(_("data={value!r} is not a directory; allowed: one "
                               "written by `python -m dtlib.train.data prepare`"
                               ).format(value=self.data))
        if self.data is not None and self.eval_every and self.eval_fraction == 0:
            raise ValueError(_("eval_every={every} needs a held-out split; "
                               "eval_fraction=0 holds out nothing; allowed: > 0"
                               ).format(every=self.eval_every))
        for name in ("weight_decay", "grad_clip", "peak_flops"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(_("{name}={value!r} must be finite and >= 0").format(
                    name=name, value=getattr(self, name)))
        if self.ckpt_dir is not None and os.path.exists(self.ckpt_dir) \
                and not os.path.isdir(self.ckpt_dir):
            raise ValueError(_("{name}={value!r} is a file; allowed: a directory (it "
                               "is created if missing)").format(
                name="ckpt_dir", value=self.ckpt_dir))
        for name in ("summary_json", "log_file"):
            if getattr(self, name) is not None and os.path.isdir(getattr(self, name)):
                raise ValueError(_("{name}={value!r} is a directory; allowed: a file "
                                   "path").format(name=name, value=getattr(self, name)))
        if self.warmup >= self.steps:
            raise ValueError(_("warmup={warmup} must be < steps={steps} (the "
                               "schedule warms up, then decays); allowed: 0 to {last}"
                               ).format(warmup=self.warmup, steps=self.steps,
                                        last=self.steps - 1))
        _int("tp", self.tp, minimum=1)
        for name in ("diloco", "powersgd"):
            _int(name, getattr(self, name), minimum=0)
            if getattr(self, name) and self.strategy != "ddp":
                raise ValueError(_("{name}={value} needs strategy='ddp' (a whole "
                                   "replica on every rank), not strategy={strategy!r}"
                                   "; allowed with fsdp: {name}=0").format(
                    name=name, value=getattr(self, name), strategy=self.strategy))
        _int("powersgd_start", self.powersgd_start, minimum=2)
        if self.diloco and self.powersgd:
            raise ValueError(_("diloco={diloco} and powersgd={powersgd} are both set; "
                               "allowed: one (DiLoCo sends no gradients to compress)"
                               ).format(diloco=self.diloco, powersgd=self.powersgd))
        if self.diloco and self.precision == "fp16":
            raise ValueError(_("diloco={diloco} with precision='fp16' is not "
                               "supported (the loss scaler would skip inner steps "
                               "unseen by the outer step); allowed: fp32 or bf16"
                               ).format(diloco=self.diloco))
        if self.tp > 1 and self.strategy != "fsdp":
            raise ValueError(_("tp={tp} needs strategy='fsdp' (FSDP2 on the dp "
                               "dimension of a (dp, tp) mesh), not strategy="
                               "{strategy!r}; allowed with ddp: tp=1").format(
                tp=self.tp, strategy=self.strategy))
        if self.tp > 1 and self.model != "gpt":
            raise ValueError(_("tp={tp} is implemented for model='gpt' only, not "
                               "model={model!r}; allowed: tp=1").format(
                tp=self.tp, model=self.model))
        if self.n_heads % self.tp:
            raise ValueError(_("tp={tp} must divide n_heads={heads} (each rank "
                               "computes whole heads); allowed: a divisor of it"
                               ).format(tp=self.tp, heads=self.n_heads))
        if self.strategy == "fsdp" and self.precision == "fp16":
            raise ValueError(_("precision='fp16' with strategy='fsdp' is not "
                               "supported (it needs a ShardedGradScaler); allowed: "
                               "fp32, bf16"))

    @property
    def allow_change_names(self) -> list[str]:
        """``allow_change`` as a list of names."""
        text = self.allow_change if isinstance(self.allow_change, str) else ""
        return [n.strip() for n in text.split(",") if n.strip()]

    @property
    def tokens_per_micro_batch(self) -> int:
        """Target tokens one rank processes per micro-batch."""
        return self.micro_batch * self.seq_len


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(_("{name}={value!r} is not allowed; allowed: {allowed}"
                           ).format(name=name, value=value, allowed=allowed))


def _int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(_("{name}={value!r} must be an integer >= {minimum}"
                           ).format(name=name, value=value, minimum=minimum))


def build_parser() -> argparse.ArgumentParser:
    """An ``argparse`` parser with one ``--flag-name`` per :class:`TrainConfig` field.

    Types and defaults come from the dataclass; help texts from its docstring.

    Taught in: Chapter 10, "The script's structure".
    """
    doc = field_docs()
    parser = argparse.ArgumentParser(
        prog="python -m dtlib.train",
        description="Train the book's GPT or a Hugging Face Llama with DDP or FSDP2 "
                    "(run under torchrun).", epilog=ZERO_TURNS_OFF)
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else None
        text = doc.get(f.name, "")
        if str(f.type) == "bool":  # a switch: present or absent
            parser.add_argument("--" + f.name.replace("_", "-"), action="store_true",
                                help=text)
            continue
        kind = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
        choices = CHOICES.get(f.name)
        shown = "" if "default:" in text or default is None else \
            f" (default: {default})"  # once: the docstring's, or argparse's
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind,
                            default=default, help=text + shown,
                            metavar="{" + ",".join(choices) + "}" if choices
                            else None)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Command line -> validated :class:`TrainConfig`.

    An invalid value stops the program here, before any process group, model or
    file exists, with argparse's one-line ``error:`` naming the flag (exit code 2).

    Args:
        argv: the arguments without the program name (default: ``sys.argv[1:]``).
    Returns:
        The configuration.

    Taught in: Chapter 10, "The script's structure".
    """
    parser = build_parser()
    argv = None if argv is None else list(argv)
    ns = parser.parse_args(argv)
    if ns.config is not None:  # the file's values become defaults; flags override
        parser.set_defaults(**read_toml(ns.config, parser))
        ns = parser.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(ns))
        check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:  # one line naming the flag, as argparse's own errors
        name = re.match(r"(\w+)=", str(exc))
        flag = f"argument --{name.group(1).replace('_', '-')}: " if name else ""
        _error(parser, flag + str(exc))
    return cfg


def _error(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's ``error:`` line and exit status 2, printed by rank 0 only (every
    rank of a torchrun job parses the same flags and would print the same line)."""
    if os.environ.get("RANK", "0") != "0":
        raise SystemExit(2)
    parser.error(message)


def read_toml(path: str, parser: argparse.ArgumentParser) -> dict[str, object]:
    """``--config run.toml`` -> ``{field: value}``: keys are the flags' names
    (``accum-steps`` or ``accum_steps``), values converted as the flag converts them.
    A file that cannot be read, an unknown key or a bad value stops the program with
    argparse's one-line error.

    Taught in: Chapter 10, "The script's structure".
    """
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            parser.error("argument --config: reading TOML needs Python >= 3.11 or "
                         "the tomli package (pip install tomli)")
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        parser.error(f"argument --config: {path}: {exc}")
    kinds = {a.dest: bool if isinstance(a.const, bool) else a.type
             for a in parser._actions if a.dest != "help"}
    out: dict[str, object] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in kinds or name == "config":
            parser.error(f"argument --config: {path}: unknown key {key!r}; allowed: "
                         "the flags' names, e.g. 'accum-steps'")
        kind = kinds[name] or str
        if (kind is bool) != isinstance(value, bool) or isinstance(
                value, (dict, list)) or (kind is int and isinstance(
                value, float)) or (kind is not str and isinstance(value, str)):
            parser.error(f"argument --config: {path}: {key} = {value!r} is not "
                         f"a{'n' if kind is int else ''} {kind.__name__}")
        out[name] = kind(value)
    return out


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """What depends on the world size: ``tp`` divides it, and one global batch
    (of ``world_size / tp`` data-parallel ranks) fits in the dataset.

    Raises:
        ValueError: ``tp`` not a divisor of ``world_size``; ``dataset_size``
            smaller than ``micro_batch x accum_steps x dp`` (a step would find no
            data).

    Taught in: Chapter 10, "The script's structure".
    """
    if world_size % cfg.tp:
        raise ValueError(_("tp={tp} must divide the world size {world} (mesh dp x "
                           "tp); allowed: a divisor of it").format(
            tp=cfg.tp, world=world_size))
    dp = world_size // cfg.tp
    batch = cfg.micro_batch * cfg.accum_steps * dp
    if cfg.data is not None:
        check_data(cfg, batch)
    elif cfg.dataset_size < batch:
        raise ValueError(_("dataset_size={size} is smaller than one global batch "
                           "(micro_batch {micro} x accum_steps {accum} x dp ranks "
                           "{dp} = {batch}); allowed: >= {batch}").format(
            size=cfg.dataset_size, micro=cfg.micro_batch, accum=cfg.accum_steps, dp=dp,
            batch=batch))


def check_data(cfg: TrainConfig, batch: int) -> None:
    """``--data``: the token file's vocabulary fits ``vocab_size``, and its training
    split holds one global batch of ``batch`` windows.

    Taught in: Chapter 10, "Real token files".
    """

    tokens, meta = open_tokens(cfg.data)  # a missing or truncated tokens.bin
    if meta["vocab_size"] > cfg.vocab_size:
        raise ValueError(_("vocab_size={vocab} is smaller than the token file's "
                           "vocabulary ({file_vocab}, {data}); allowed: >= "
                           "{file_vocab}").format(vocab=cfg.vocab_size,
                                                  file_vocab=meta["vocab_size"],
                                                  data=cfg.data))
    windows = TokenWindows.count(len(tokens), cfg.seq_len)
    if windows < 1:
        raise ValueError(_("seq_len={seq} is longer than the token file ({data} "
                           "has {n} tokens; a sample needs seq_len + 1); allowed: <= "
                           "{most}").format(seq=cfg.seq_len, data=cfg.data,
                                            n=len(tokens), most=len(tokens) - 1))
    train, _held_out = held_out_split(windows, cfg.eval_fraction)
    if train < batch:
        raise ValueError(_("data={data!r} has {train} training windows of seq_len + "
                           "1 tokens, fewer than one global batch ({batch}); allowed: "
                           "a larger corpus or a smaller batch").format(
            data=cfg.data, train=train, batch=batch))


def field_docs() -> dict[str, str]:
    """Field name -> its line(s) in the :class:`TrainConfig` docstring (the flags'
    help texts, and the chapter's table of flags).

    Taught in: Chapter 10, "The script's structure".
    """
    docs: dict[str, str] = {}
    name = None
    for line in (TrainConfig.__doc__ or "").splitlines():
        head, sep, text = line.strip().partition(": ")
        if sep and head.isidentifier() and line.startswith("    ") \
                and not line.startswith("        "):
            name = head
            docs[name] = text
        elif name and line.startswith("        "):
            docs[name] += " " + line.strip()
    return docs
