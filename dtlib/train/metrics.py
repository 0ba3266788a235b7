"""What a practitioner reads while the capstone trains: one line per logged step.

Every logged line (and one JSON line in the run's log file, :class:`RunLog`) has the
step, the global loss, the learning rate, the global gradient norm before clipping,
the step time and tokens/s (the mean over the steps since the last line, measured
from step end to step end with the saves, evaluations and logging taken out, so
neither start-up nor checkpoints are in them), the MFU and the peak memory:

- MFU (model FLOPs utilisation, Chowdhery et al. 2022, App. B) is the model's FLOPs
  per step over the time of the step times the peak of every device: per token
  ``6 N`` for the parameters' matmuls forward and backward plus ``12 l s h`` for
  attention's scores and weighted sums (:func:`flops_per_token`). Recomputation is
  not counted: it is work the hardware does, not the model (that is HFU). The peak
  is ``--peak-flops`` or, without it, a matmul measured on the device at start-up
  (Chapter 13's :func:`dtlib.planner.measure.matmul_flops`, its best window); the
  first line says which.
- peak memory is the CUDA caching allocator's high-water mark of allocated bytes on
  a GPU, the process's peak resident set (``ru_maxrss``) on the CPU; the line names
  which.

:func:`evaluate` is the held-out loss every ``--eval-every`` steps: the mean
per-token loss over the same first ``eval_samples`` held-out samples whatever the
world size (each data-parallel rank sums its share, one all-reduce of the sum and
the count).

Taught in: Chapter 10, "What the log says".
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.models.run import logits_of
from dtlib.runtime import dist as ddist

__all__ = ["flops_per_token", "peak_memory", "evaluate",
           "RunLog", "tensorboard_writer"]


def flops_per_token(n_params: int, n_layers: int, seq_len: int, hidden: int) -> int:
    """Model FLOPs of one trained token: ``6 N + 12 l s h`` (Chowdhery et al. 2022,
    App. B: 2 per multiply-add, backward twice the forward; the attention term is
    QK^T and scores x V, which have no parameters).

    Taught in: Chapter 10, "What the log says".
    """
    return 6 * n_params + 12 * n_layers * seq_len * hidden


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(peak bytes, what they are): the CUDA allocator's peak allocated bytes on a
    GPU, the process's peak resident set on the CPU.

    Taught in: Chapter 10, "What the log says".
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(rss) * (1 if sys.platform == "darwin" else 1024), "peak RSS"


@torch.no_grad()
def evaluate(job: Any) -> float:
    """The mean per-token loss of the first ``eval_samples`` held-out samples (cut to
    a multiple of the data-parallel ranks, so every rank runs as many forwards).

    Every rank calls it (FSDP gathers parameters in the forward).

    Taught in: Chapter 10, "What the log says".
    """
    cfg, par, held = job.cfg, job.par, job.held_out
    dp = par.dp_size
    n = min(cfg.eval_samples, len(held)) // dp * dp
    if n == 0:
        raise ValueError(f"eval_samples={cfg.eval_samples}: the held-out split has "
                         f"{len(held)} samples, fewer than the {dp} data-parallel "
                         "ranks; allowed: a larger eval_fraction or corpus")
    rank = dist.get_rank(par.dp_group) if dp > 1 else 0
    mine = torch.arange(rank, n, dp)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    device = job.world.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    job.model.eval()
    for chunk in mine.split(cfg.micro_batch):
        rows = held.rows(chunk).to(device)
        amp = torch.autocast(device.type, dtype=low) if low is not None \
            and job.strategy.autocast else torch.autocast(device.type, enabled=False)
        with amp:
            logits = logits_of(job.model(rows[:, :-1]))
        total[0] += F.cross_entropy(logits.float().flatten(0, 1),
                                    rows[:, 1:].flatten(), reduction="sum").double()
        total[1] += rows[:, 1:].numel()
    job.model.train()
    if dp > 1:
        dist.all_reduce(total, group=par.dp_group)
    loss_sum, count = total.tolist()  # the evaluation's one host sync
    return loss_sum / count


class RunLog:
    """Rank 0's log: a printed line and a JSON line (appended to ``path``) per record,
    and, with ``tensorboard`` (a directory), the record's numbers as TensorBoard
    scalars at its step (the same names as the JSON keys).

    Taught in: Chapter 10, "What the log says".
    """

    def __init__(self, path: str | None, tensorboard: str | None = None) -> None:
        main = ddist.world().is_main
        self.path = path if main else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.board = tensorboard_writer(tensorboard) if tensorboard and main else None

    def header(self, record: dict[str, Any]) -> None:
        """Append ``record`` (``{"run": fingerprint, "start_step", ...}``) without
        printing it: the first line of a log says whose it is, and each start of
        the run adds one (:func:`dtlib.train.identity.check_log` reads it)."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def write(self, record: dict[str, Any], line: str) -> None:
        """Print ``line`` on rank 0 and append ``record`` to the log file."""
        ddist.rprint(line)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    self.board.add_scalar(key, value, record["step"])

    def close(self) -> None:
        """Flush the TensorBoard events to disk."""
        if self.board is not None:
            self.board.close()


def tensorboard_writer(logdir: str) -> Any:
    """A TensorBoard ``SummaryWriter`` on ``logdir``, or None when the tensorboard
    package is not installed: the run then says so in one line and goes on (the
    JSON log has the same numbers).

    Taught in: Chapter 10, "What the log says".
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's wrapper needs the tensorboard package
        ddist.rprint(f"--tensorboard {logdir}: the tensorboard package is not "
                     "installed (pip install 'dtlib[tensorboard]'); continuing "
                     "without TensorBoard scalars (the JSON log has them)")
        return None
    return SummaryWriter(logdir)
