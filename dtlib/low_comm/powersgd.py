"""Gradient compression as a DDP communication hook: PowerSGD.

A *communication hook* replaces the all-reduce of one gradient bucket. DDP hands it
the bucket (one flat buffer holding several gradients) and takes back a future whose
value is the *averaged* buffer. Both DDPs of the book take the same hook:
torch's ``model.register_comm_hook(state, hook)`` and Chapter 3's
:meth:`~dtlib.data_parallel.DataParallel.register_comm_hook`.

- :func:`powersgd_hook`, PowerSGD (Vogels et al., 2019): every gradient matrix ``M``
  (``n x m``) of the bucket travels as two thin factors, ``P = M Q`` (``n x r``) and
  ``Q = M^T P`` (``m x r``): ``r (n + m)`` elements instead of ``n m``
  (:func:`powersgd_elements`). One step of a bucket is three all-reduces: the
  tensors not worth compressing (vectors, small matrices) as they are, all the P's,
  then all the Q's. Between them, P is orthogonalised, and the average is rebuilt
  as ``P Q^T``: the best rank-``r`` approximation power iteration reaches. What the
  approximation misses stays on the rank (*error feedback*) and is added to the
  next step's gradient; each step starts from the last step's Q (*warm start*), so
  one power-iteration step per training step converges over the steps.
- the 16-bit hook is :mod:`dtlib.low_comm.low_precision`.

The schedule and the arithmetic are torch's ``powerSGD_hook``, written out, so that
the same settings train the same model bit for bit (the tests prove it): plain
all-reduces before ``start_iter``, the same rule for what is compressed, the same
order of the matrices in the P and Q buffers (grouped by shape), the same random Q
from the same seed, and Gram-Schmidt for ``r <= 2`` (QR above).

Taught in: Chapter 15, "When the network is slow".
"""

# No ``from __future__ import annotations`` here: torch DDP's register_comm_hook
# reads a hook's annotations and accepts only the real dist.GradBucket and
# torch.futures.Future[torch.Tensor], not their names as strings.

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["PowerSGDState", "powersgd_hook", "should_compress", "powersgd_elements",
           "powersgd_bytes"]


# ---- the arithmetic -----------------------------------------------------------------

def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether an ``n x m`` matrix is worth sending as rank-``rank`` factors: when
    ``r (n + m) * min_compression_rate < n m``, with ``r = min(n, m, rank)``.

    A vector (``m = 1``) never is unless ``min_compression_rate < n / (n + 1)``.

    Taught in: Chapter 15, "PowerSGD".
    """
    r = min(n, m, rank)
    return r * (n + m) * min_compression_rate < n * m


def powersgd_elements(shapes: Sequence[Sequence[int]], rank: int,
                      min_compression_rate: float = 2.0) -> tuple[int, int, int]:
    """Elements one bucket's PowerSGD step all-reduces: ``(plain, p, q)``.

    Args:
        shapes: the shapes of the bucket's gradients.
        rank, min_compression_rate: as :class:`PowerSGDState`'s.
    Returns:
        ``plain``: the elements of the tensors sent as they are; ``p``: ``sum n r``
        and ``q``: ``sum m r`` over the compressed ``n x m`` matrices (``r =
        min(n, m, rank)``), where a plain all-reduce would send ``sum n m``.

    Taught in: Chapter 15, "PowerSGD".
    """
    plain = p = q = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = int(np.prod(shape[1:], dtype=np.int64))
        if should_compress(n, m, rank, min_compression_rate):
            r = min(n, m, rank)
            p, q = p + n * r, q + m * r
        else:
            plain += n * m
    return plain, p, q


def powersgd_bytes(buckets: Sequence[Sequence[Sequence[int]]], rank: int,
                   min_compression_rate: float = 2.0, element_size: int = 4) -> int:
    """Bytes one compressed step all-reduces: :func:`powersgd_elements` summed over
    the buckets (each a list of gradient shapes), times ``element_size``.

    Taught in: Chapter 15, "PowerSGD".
    """
    return element_size * sum(sum(powersgd_elements(b, rank, min_compression_rate))
                              for b in buckets)


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Make the columns of ``matrix`` (``k x r``, ``r <= k``) orthonormal, in place,
    spanning what they spanned: Gram-Schmidt for ``r <= 2`` or a 16-bit dtype (QR
    has no 16-bit kernels), Householder QR otherwise (torch's choice, so both
    hooks round alike). A column of zeros makes NaNs, as in torch's (epsilon 0).

    Taught in: Chapter 15, "PowerSGD".
    """
    r = matrix.shape[1]
    if r <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrix[:, i:i + 1]
            col /= torch.linalg.vector_norm(col, dim=0, keepdim=True)
            rest = matrix[:, i + 1:]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    else:
        matrix.copy_(torch.linalg.qr(matrix[None]).Q[0])  # a batch of one, as torch
    return matrix


def orthogonalized(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`orthogonalize` each matrix, in place; the same list.

    Taught in: Chapter 15, "PowerSGD".
    """
    for mat in matrices:
        orthogonalize(mat)
    return matrices


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a batch of one: torch's hook multiplies batches, and on a CPU a
    small batched product may take another kernel (another order of the sums)."""
    return torch.bmm(a[None], b[None])[0]


# ---- PowerSGD -----------------------------------------------------------------------

@dataclass(eq=False)
class PowerSGDState:
    """PowerSGD's settings and what it remembers between steps, for all buckets.

    Args:
        matrix_rank: ``r``, the rank of the factors (torch's
            ``matrix_approximation_rank``; ``rank`` is a process's index here).
        start_iter: plain all-reduces for the first ``start_iter`` steps
            (gradients early in training are not low-rank enough); >= 2 with warm
            start or error feedback, since torch DDP regroups its buckets after
            step 1 and the memory is per bucket.
        min_compression_rate: compress a matrix only if it shrinks by more than
            this (:func:`should_compress`); 0 compresses every tensor.
        warm_start: start each step's power iteration from the last step's Q.
        error_feedback: add what compression missed to the next step's gradient.
        seed: seeds the random first Q, the same on every rank.
        group: the data-parallel process group (default: the whole world).

    State: ``iteration`` (steps seen), ``errors`` and ``qs`` (by bucket index).

    Taught in: Chapter 15, "PowerSGD".
    """

    matrix_rank: int = 1
    start_iter: int = 1000
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0
    group: Any = None
    iteration: int = field(default=0, init=False)
    errors: dict[int, torch.Tensor] = field(default_factory=dict, init=False,
                                            repr=False)
    qs: dict[int, torch.Tensor] = field(default_factory=dict, init=False,
                                        repr=False)

    def __post_init__(self) -> None:
        def whole(name: str, low: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PowerSGDState({name}={value!r}): must be an "
                                 f"integer >= {low}")
        whole("matrix_rank", 1)
        whole("start_iter", 0)
        whole("seed", 0)
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) \
                or not rate >= 0:
            raise ValueError(f"PowerSGDState(min_compression_rate={rate!r}): must "
                             "be a number >= 0")
        for name in ("warm_start", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PowerSGDState({name}={getattr(self, name)!r}): "
                                 "must be True or False")
        if (self.warm_start or self.error_feedback) and self.start_iter < 2:
            raise ValueError(f"PowerSGDState(start_iter={self.start_iter}): must be "
                             ">= 2 with warm_start or error_feedback (torch DDP "
                             "regroups its buckets after step 1)")
        # numpy's generator, as torch's: one seed per bucket for its first Q
        self._rng = np.random.RandomState(self.seed)

    def next_seed(self) -> int:
        """A seed for a bucket's random Q: the same on every rank (all draw in
        the same order), another each time."""
        return int(self._rng.randint(1_000_000_000))

    def _config(self) -> dict[str, Any]:
        return {"matrix_rank": self.matrix_rank, "start_iter": self.start_iter,
                "min_compression_rate": self.min_compression_rate,
                "warm_start": self.warm_start, "error_feedback": self.error_feedback}

    def state_dict(self) -> dict[str, Any]:
        """Settings, ``iteration``, the error and Q of every bucket (by
        ``str(index)``) and the seed generator: what an exact resume needs. The
        memory is per bucket: under torch DDP, let the resumed model regroup its
        buckets (``settle_ddp_buckets``) before registering the hook.

        Taught in: Chapter 15, "Resuming a compressed run"."""
        _, keys, pos, has_gauss, gauss = self._rng.get_state()
        return {"config": self._config(), "iteration": self.iteration,
                "errors": {str(b): e.clone() for b, e in self.errors.items()},
                "qs": {str(b): q.clone() for b, q in self.qs.items()},
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)),
                        "pos": int(pos), "has_gauss": int(has_gauss),
                        "gauss": float(gauss)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the settings must be the same.

        Taught in: Chapter 15, "Resuming a compressed run"."""
        for name, value in state["config"].items():
            if getattr(self, name) != value:
                raise ValueError(f"PowerSGDState({name}={getattr(self, name)!r}) "
                                 f"cannot load a state saved with {name}={value!r}")
        self.iteration = int(state["iteration"])
        self.errors = {int(b): e.clone() for b, e in state["errors"].items()}
        self.qs = {int(b): q.clone() for b, q in state["qs"].items()}
        rng = state["rng"]
        self._rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32),
                             rng["pos"], rng["has_gauss"], rng["gauss"]))


def _views(flat: torch.Tensor, rows: list[int], ranks: list[int]
           ) -> list[torch.Tensor]:
    """``flat`` cut into consecutive ``rows[i] x ranks[i]`` matrices (views)."""
    sizes = [k * r for k, r in zip(rows, ranks)]
    return [x.view(k, r) for x, k, r in zip(flat.split(sizes), rows, ranks)]


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _plain_average(buffer: torch.Tensor, group: Any) -> torch.futures.Future:
    """Divide, then all-reduce (sum): the average, as torch's default hook."""
    buffer.div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _same_size(kept: int, now: int, b: int) -> None:
    if kept != now:
        raise RuntimeError(f"bucket {b}: PowerSGD kept {kept} elements for it, it "
                           f"now needs {now}: the buckets changed "
                           "since compression started (start_iter >= 2 lets torch "
                           "DDP regroup them first)")


def _split(bucket: Any, buffer: torch.Tensor, state: PowerSGDState
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The bucket's gradients as matrices (rows: the first dimension), views of
    ``buffer``: those sent as they are, and those sent as factors, grouped by
    shape in order of first appearance (torch's layout of the P and Q buffers)."""
    grads = bucket.gradients()
    views = buffer.split([g.numel() for g in grads])
    plain, matrices = [], []
    for v, g in zip(views, grads):
        mat = v.view(g.shape[0] if g.dim() else 1, -1)
        n, m = mat.shape
        compress = should_compress(n, m, state.matrix_rank,
                                   state.min_compression_rate)
        (matrices if compress else plain).append(mat)
    first_of_shape: dict[torch.Size, int] = {}
    for mat in matrices:
        first_of_shape.setdefault(mat.shape, len(first_of_shape))
    matrices.sort(key=lambda mat: first_of_shape[mat.shape])
    return plain, matrices


def _random_qs(qs: list[torch.Tensor], seed: int) -> None:
    """Fill each Q, in order, from one generator seeded with ``seed`` (on the CPU,
    so every device draws the same numbers)."""
    gen = torch.Generator().manual_seed(seed)
    for q in qs:
        q.copy_(torch.randn(q.shape, generator=gen, dtype=q.dtype))


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket
                  ) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket's gradients with PowerSGD (see the module docstring).

    Args:
        state: a :class:`PowerSGDState`, one for all buckets of the model.
        bucket: a ``torch.distributed.GradBucket`` (torch DDP) or Chapter 3's
            bucket view: ``buffer()``, ``gradients()``, ``index()``, ``is_last()``.
    Returns:
        A completed future holding the bucket's buffer, now the average's
        approximation. The three all-reduces are waited for here, in order (torch
        chains them with ``then``: the same arithmetic, more overlap).

    Taught in: Chapter 15, "PowerSGD".
    """
    buffer, b = bucket.buffer(), bucket.index()
    if state.iteration < state.start_iter:
        state.iteration += bucket.is_last()
        return _plain_average(buffer, state.group)
    world_size = dist.get_world_size(state.group)
    # 1. error feedback: send what the last step's approximation missed, too
    if state.error_feedback:
        if b in state.errors:
            _same_size(state.errors[b].numel(), buffer.numel(), b)
            buffer.add_(state.errors[b])
        before = buffer.clone()
    # 2. the gradients as views of the buffer: sent as they are, or as factors
    plain, matrices = _split(bucket, buffer, state)
    ranks = [min(*mat.shape, state.matrix_rank) for mat in matrices]
    # 3. one flat buffer of all P's, one of all Q's (kept); a view per matrix
    p_flat = buffer.new_empty(sum(mat.shape[0] * r for mat, r in zip(matrices, ranks)))
    ps = _views(p_flat, [mat.shape[0] for mat in matrices], ranks)
    q_numel = sum(mat.shape[1] * r for mat, r in zip(matrices, ranks))
    fresh = not state.warm_start or b not in state.qs
    if fresh:
        state.qs[b] = buffer.new_empty(q_numel)
    _same_size(state.qs[b].numel(), q_numel, b)
    qs = _views(state.qs[b], [mat.shape[1] for mat in matrices], ranks)
    if fresh:
        _random_qs(qs, state.next_seed())
    # 4. P = M Q, and the plain tensors leave meanwhile
    for mat, p, q in zip(matrices, ps, orthogonalized(qs)):
        p.copy_(_mm(mat, q))
    if plain:
        flat_plain = torch.cat([t.reshape(-1) for t in plain])
        work = dist.all_reduce(flat_plain, group=state.group, async_op=True)
    # 5. sum the P's, orthogonalise; Q = M^T P; average the Q's
    if matrices:
        dist.all_reduce(p_flat, group=state.group)
        for mat, p, q in zip(matrices, orthogonalized(ps), qs):
            q.copy_(_mm(mat.T, p))
        dist.all_reduce(state.qs[b], group=state.group)
        state.qs[b].div_(world_size)
    # 6. the average's rank-r approximation P Q^T, and the plain average
    for mat, p, q in zip(matrices, ps, qs):
        mat.copy_(_mm(p, q.T))
    if plain:
        work.wait()
        flat_plain.div_(world_size)
        for t, avg in zip(plain, flat_plain.split([t.numel() for t in plain])):
            t.copy_(avg.view_as(t))
    # 7. remember what was missed (a plain tensor's: its own minus the average)
    if state.error_feedback:
        state.errors[b] = before - buffer
    if not state.warm_start:
        del state.qs[b]
    state.iteration += bucket.is_last()
    return _done(buffer)
