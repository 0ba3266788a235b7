"""The world a rank lives in: rank, device and backend, chosen in exactly one place.

Every other module asks this one. Nothing else in dtlib reads ``RANK`` or
``LOCAL_RANK`` or writes ``cuda:{i}`` by hand, so the same code runs as four gloo
processes on a laptop, as eight NCCL processes on one GPU node, and across nodes under
torchrun's rendezvous.

Taught in: Chapter 0, "Hello, distributed".
"""

from __future__ import annotations

import atexit
import os
import platform
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dtlib.runtime import worker

BACKENDS = ("gloo", "nccl")
#: Seconds a collective may wait for its peers before the group raises. Long enough for
#: a slow first NCCL communicator, short enough that a deadlock becomes an error.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("DTLIB_COLLECTIVE_TIMEOUT", "300"))


@dataclass(frozen=True)
class World:
    """Where this process stands in the job.

    rank: global index of this process, 0 .. world_size - 1.
    local_rank: index on this machine; chooses the GPU (``cuda:local_rank``).
    world_size: number of processes in the job (all machines).
    backend: the communication library, ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
    device: where this rank's tensors live.
    """

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes files."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={value} must be >= 0")
    return value


def _from_env() -> tuple[int, int, int]:
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size} must be >= 1")
    if rank >= world_size:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world_size}")
    return rank, local_rank, world_size


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(local_rank: int, backend: str | None = None,
                   local_world_size: int | None = None) -> str:
    """One backend for the whole world: NCCL when *every* rank on this machine has a
    GPU of its own, gloo otherwise.

    Deciding per rank ("NCCL if my local rank has a GPU") splits a world of 4 ranks on
    a 2-GPU machine into NCCL and gloo ranks, whose first collective waits forever.
    The rule here gives the same answer on every rank of a machine (same GPU count,
    same ``LOCAL_WORLD_SIZE``); :func:`init` checks that all ranks agree before it
    joins the group.

    Args:
        local_rank: this process's index on its machine.
        backend: force ``"gloo"`` or ``"nccl"``; ``None`` chooses. The environment
            variable ``DTLIB_BACKEND`` overrides the automatic choice too.
        local_world_size: ranks on this machine (default: ``LOCAL_WORLD_SIZE``, or
            ``local_rank + 1`` when unset).
    Returns:
        ``"gloo"`` or ``"nccl"``.
    """
    backend = backend or os.environ.get("DTLIB_BACKEND") or None
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {BACKENDS}")
    if local_world_size is None:
        local_world_size = _env_int("LOCAL_WORLD_SIZE", local_rank + 1)
    gpus = _gpus()
    if backend == "nccl" and local_rank >= gpus:
        raise ValueError(
            f"backend='nccl' needs a CUDA device for local_rank={local_rank}; "
            f"this machine has {gpus} (use 'gloo' on CPU)"
        )
    if backend is None:
        backend = "nccl" if 0 < gpus and local_world_size <= gpus else "gloo"
    return backend


def too_few_gpus(local_world_size: int) -> str | None:
    """The message a launch on a CUDA machine with fewer GPUs than ranks prints (every
    rank then runs on the CPU with gloo), or None when there is nothing to say."""
    gpus = _gpus()
    if 0 < gpus < local_world_size:
        return (f"dtlib: {local_world_size} ranks on this machine but {gpus} GPUs: "
                "every rank runs on the CPU with gloo (one backend per world). Start "
                f"at most {gpus} ranks (%%torchrun or spawn without -n) to use the "
                "GPUs.")
    return None


def agree_backend(store: Any, rank: int, world_size: int, backend: str) -> None:
    """Check, through the rendezvous store and before joining the group, that every
    rank chose the same backend: a mixed world would hang in its first collective.

    Raises:
        RuntimeError: naming which ranks chose which backend.

    Taught in: Chapter 0, "One backend per world".
    """
    store.set(f"dtlib/backend/{rank}", backend)
    chosen = [store.get(f"dtlib/backend/{r}").decode() for r in range(world_size)]
    if len(set(chosen)) > 1:
        by = {b: [r for r, c in enumerate(chosen) if c == b]
              for b in sorted(set(chosen))}
        raise RuntimeError(
            "ranks chose different backends, which would hang at the first "
            f"collective: {by}. Give every machine as many GPUs as ranks, or set "
            "DTLIB_BACKEND=gloo for all ranks")


def _device_for(backend: str, local_rank: int) -> torch.device:
    return (torch.device("cuda", local_rank) if backend == "nccl"
            else torch.device("cpu"))


def world() -> World:
    """The current world, initialised or not (a lone process is a world of one)."""
    rank, local_rank, world_size = _from_env()
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
        return World(dist.get_rank(), local_rank, dist.get_world_size(), backend,
                     _device_for(backend, local_rank))
    backend = choose_backend(local_rank)
    return World(rank, local_rank, world_size, backend,
                 _device_for(backend, local_rank))


def init(
    backend: str | None = None,
    *,
    timeout: float | timedelta | None = None,
    store: Any = None,
) -> World:
    """Join the process group described by torchrun's environment.

    Reads RANK, LOCAL_RANK, WORLD_SIZE (and MASTER_ADDR/MASTER_PORT through ``env://``),
    chooses the backend, sets the CUDA device *before* creating the group, and always
    passes a timeout so that a rank that never arrives becomes an error, not a hang.
    Without torchrun it makes a world of one, so a notebook can call it directly.
    Calling it again returns the same world.

    It does not ``torch.set_default_device(device)``: that routes every torch call
    through a Python function mode (measured on CPU: a 4-element add 1.7-1.9x
    slower), and seeded initialisation would then draw on the GPU, not the weights the
    single-process reference builds. Rank code names ``world.device`` instead, and
    ``tests/test_device_placement.py`` checks that it does.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` to choose (see
            :func:`choose_backend`).
        timeout: seconds (or a timedelta) a collective waits for its peers.
        store: a ``torch.distributed.Store`` to rendezvous through instead of ``env://``
            (used by :func:`dtlib.runtime.launch.spawn`).
    Returns:
        The :class:`World` of this process.

    Taught in: Chapter 0.
    """
    if dist.is_initialized():
        # A script run on ranks that joined before it started (launch.spawn_script)
        # joins here, as far as its launch's timeout is concerned.
        _note_joined(dist.get_rank())
        return world()
    rank, local_rank, world_size = _from_env()
    local_world_size = _env_int("LOCAL_WORLD_SIZE", local_rank + 1)
    backend = choose_backend(local_rank, backend, local_world_size)
    why = too_few_gpus(local_world_size) if backend == "gloo" else None
    if why and local_rank == 0:
        print(why, file=sys.stderr, flush=True)
    if timeout is None:
        timeout = COLLECTIVE_TIMEOUT_S
    if not isinstance(timeout, timedelta):
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        timeout = timedelta(seconds=float(timeout))
    device = _device_for(backend, local_rank)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if device.type == "cuda":
        # Set the device first: otherwise the first NCCL call of every rank lands on
        # GPU 0.
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if store is None and world_size == 1 and "MASTER_ADDR" not in os.environ:
        store = dist.HashStore()  # a world of one needs no network rendezvous
    if store is None:  # torchrun's env://, opened here so that ranks can compare
        store = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))[0]
        # torchrun keeps its store across restarts (--max-restarts): without a
        # prefix per attempt, a restarted group reads the dead group's addresses.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None:
            store = dist.PrefixStore(f"attempt_{attempt}/", store)
    if world_size > 1:
        agree_backend(store, rank, world_size, backend)
    kwargs.update(store=store, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    if world_size > 1:
        # Every rank leaves init connected to every other: a fast rank that finishes
        # and exits must not make a slow peer fail inside init, where no report can
        # say which of the reader's collectives it was waiting for.
        dist.barrier()
    _note_joined(rank)  # a launch's timeout starts once every rank is here
    # Leaving without destroying the group makes some torch versions abort at exit
    # ("terminate called without an active exception"); a script need not remember.
    atexit.register(destroy)
    return World(rank, local_rank, world_size, backend, device)


def _note_joined(rank: int) -> None:
    """Tell the dtlib launcher that started this rank (if any) that it has joined:
    ``rank{k}.joined`` in its log folder. The launch's timeout counts from the moment
    every rank has joined, so importing torch and the rendezvous never eat into it."""
    log_dir = os.environ.get("DTLIB_LOG_DIR")
    # launch.spawn_script's ranks join before the script runs; the script's own
    # init() is the join its timeout counts from (the mark is "group" until then).
    mark = os.environ.get("DTLIB_JOINED_MARK", "joined")
    if log_dir and os.path.isdir(log_dir):
        worker.note_joined(log_dir, rank, mark)  # once, if the worker has not yet


def sync(device: torch.device | str | None = None) -> None:
    """Wait until ``device`` (default: this rank's) has finished the work queued on it.

    CUDA runs kernels asynchronously: a timer read right after a call measures the
    time to *queue* it. Call this before reading a clock around GPU work. A no-op on
    CPU, where every op has finished when it returns.

    Taught in: Chapter 0; used by every benchmark and measured timeline.
    """
    device = torch.device(device) if device is not None else world().device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_group() -> Any:
    """A new process group of every rank on the CPU backend (gloo), whatever the
    training backend: for collectives that a background thread runs on CPU tensors
    (``torch.distributed.checkpoint.async_save``'s planning), apart from the
    training group, whose collectives they would otherwise interleave with.

    A collective: every rank calls it, in the same order.

    Taught in: Chapter 10, "Crash and resume".
    """
    return dist.new_group(backend="gloo")


def destroy() -> None:
    """Leave the process group (safe to call when none exists)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_info() -> dict[str, Any]:
    """Everything a bug report about a distributed run should start with.

    Returns:
        A dict with rank, local_rank, world_size, backend, device, whether the group is
        initialised, host, pid, and the versions and devices of the stack.
    """
    w = world()
    return {
        "rank": w.rank,
        "local_rank": w.local_rank,
        "world_size": w.world_size,
        "backend": w.backend,
        "device": str(w.device),
        "initialized": dist.is_available() and dist.is_initialized(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl_available": dist.is_nccl_available(),
        "gloo_available": dist.is_gloo_available(),
    }


def rprint(*args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
    """Print from rank 0 only, or from every rank prefixed ``[rank k]``.

    It lives beside :func:`world` because it is a question to the world (which rank
    am I, was I started by the launcher), not a formatting helper.

    Under :mod:`dtlib.runtime.launch` every line is already prefixed by the launcher, so
    the prefix is not added twice.
    """
    w = world()
    if not all_ranks and w.rank != 0:
        return
    if all_ranks and not os.environ.get("DTLIB_LAUNCHED"):
        args = (f"[rank {w.rank}]", *args)
    kwargs.setdefault("flush", True)
    print(*args, **kwargs)
