"""Ring attention: exact attention over a sequence split across ranks.

Each rank holds its load-balanced share of the queries, keys and values
(``[batch, heads, local_seq, head_dim]``, see :mod:`dtlib.context_parallel.sharding`).
The K/V blocks travel around the ring: at step ``t`` rank ``r`` holds the block of rank
``r - t``, attends its own queries to it, and passes it on, while the next block is
already in flight. Softmax over blocks that arrive one at a time is the online softmax
of FlashAttention: keep the running output ``o`` and the running log-sum-exp ``lse`` of
each query row, and fold in a block with

    lse' = log(exp(lse) + exp(lse_b))
    o'   = o * exp(lse - lse') + o_b * exp(lse_b - lse')

where ``o_b`` is the block's own softmax-weighted sum of values and ``lse_b`` its
log-sum-exp. (Liu et al. 2023, Ring Attention; Dao et al. 2022 for the rescaling.)

The backward pass is a second trip around the ring. The probabilities are rebuilt from
the saved ``lse`` (no s x s matrix is kept), each rank adds its queries' share to the
dK/dV of the block it holds, and the dK/dV accumulators travel with the block, so
after ``cp`` hops every block's gradient is back on its owner.

Scores, softmax statistics, the running output and the gradient accumulators are
kept in ``torch.promote_types(float32, input dtype)``: float32 for 16-bit inputs (as
FlashAttention does), the input's own precision for float32 and float64.

Taught in: Chapter 12, "Context parallelism".
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dtlib.context_parallel.sharding import cp_world, positions


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ring attention accumulates in for inputs of ``dtype``.

    Args:
        dtype: the dtype of q, k and v.
    Returns:
        ``torch.promote_types(torch.float32, dtype)``: float32 for 16-bit inputs,
        never narrower than the input (float64 stays float64).

    Taught in: Chapter 12, "Context parallelism".
    """
    return torch.promote_types(torch.float32, dtype)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor | None,
                   k_pos: torch.Tensor | None, scale: float) -> torch.Tensor:
    # (b, a, n_q, d) @ (b, a, d, n_k) -> (b, a, n_q, n_k), at least float32 for softmax
    s = (q @ k.transpose(-2, -1)).to(accumulation_dtype(q.dtype)) * scale
    if q_pos is not None:
        # causal by global position: works for any chunk layout, load-balanced or not
        allowed = q_pos[:, None] >= k_pos[None, :]  # (n_q, n_k)
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A row whose keys are all masked has lse = -inf; subtracting it would give nan.
    return lse.masked_fill(torch.isinf(lse), 0.0)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  q_pos: torch.Tensor | None, k_pos: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries to one K/V block: its output and log-sum-exp.

    Args:
        q: ``(b, a, n_q, d)``; k, v: ``(b, a, n_k, d)``.
        q_pos, k_pos: global positions ``(n_q,)``, ``(n_k,)`` for the causal mask, or
            ``None`` for no mask.
        scale: the score scale, ``1 / sqrt(d)``.
    Returns:
        ``(o_b, lse_b)``: ``(b, a, n_q, d)`` (zero for fully masked rows) and
        ``(b, a, n_q)`` (``-inf`` for fully masked rows), both in
        :func:`accumulation_dtype`.

    Taught in: Chapter 12, "Context parallelism".
    """
    s = _masked_scores(q, k, q_pos, k_pos, scale)
    lse = torch.logsumexp(s, dim=-1)  # (b, a, n_q)
    p = torch.exp(s - _finite(lse)[..., None])  # masked entries: exp(-inf) = 0
    return (p.to(v.dtype) @ v).to(s.dtype), lse


def merge(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block into the running softmax (the log-sum-exp correction).

    Args:
        o, lse: running output ``(b, a, n, d)`` and log-sum-exp ``(b, a, n)``.
        o_b, lse_b: the block's output and log-sum-exp (from :func:`block_forward`).
    Returns:
        The updated ``(o, lse)``: exactly the softmax over all blocks seen so far.

    Taught in: Chapter 12, "Context parallelism".
    """
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    o = o * torch.exp(lse - safe)[..., None] + o_b * torch.exp(lse_b - safe)[..., None]
    return o, new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, scale: float,
                   dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one query-block / K/V-block pair, from the final log-sum-exp.

    With ``P = exp(S - lse)`` (the true softmax restricted to this block),
    ``dV = P^T dO``, ``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * O)``,
    ``dQ = dS K * scale`` and ``dK = dS^T Q * scale``.

    Args:
        q, k, v, q_pos, k_pos, scale: as in :func:`block_forward`.
        dout: gradient of the output ``(b, a, n_q, d)``.
        lse: the final log-sum-exp of the query rows ``(b, a, n_q)``.
        delta: ``rowsum(dout * out)`` ``(b, a, n_q)``.
    Returns:
        ``(dq, dk, dv)`` in :func:`accumulation_dtype`: this block's contributions.

    Taught in: Chapter 12, "Context parallelism".
    """
    s = _masked_scores(q, k, q_pos, k_pos, scale)
    p = torch.exp(s - _finite(lse)[..., None])  # (b, a, n_q, n_k)
    acc = s.dtype
    dout = dout.to(acc)
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.to(acc).transpose(-2, -1) - delta[..., None])
    dq = (ds @ k.to(acc)) * scale
    dk = (ds.transpose(-2, -1) @ q.to(acc)) * scale
    return dq, dk, dv


def _ring_peers(group: Any, rank: int, cp: int) -> tuple[int, int]:
    """Global ranks of the next and the previous member of the ring."""
    nxt, prev = (rank + 1) % cp, (rank - 1) % cp
    if group is None:
        return nxt, prev
    return dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)


def ring_exchange(send: torch.Tensor, group: Any, rank: int, cp: int, tag: int = 0
                  ) -> tuple[torch.Tensor, list[Any]]:
    """Start sending ``send`` to the next rank and receiving from the previous one.

    Both operations go in one ``batch_isend_irecv``, so every rank posts its send and
    its receive together: no rank waits on a peer that is itself blocked in a send,
    which is what makes a ring of blocking sends deadlock under NCCL.

    Args:
        send: a contiguous tensor (this rank's block).
        group, rank, cp: the ring (from :func:`cp_world`).
        tag: tells two exchanges in flight at once apart (gloo matches by tag; NCCL
            by issue order, which is the same on every rank).
    Returns:
        ``(recv, works)``: the buffer that will hold the previous rank's block, and the
        requests to ``wait()`` on before reading it.

    Taught in: Chapter 12, "Context parallelism".
    """
    nxt, prev = _ring_peers(group, rank, cp)
    recv = torch.empty_like(send)
    # Looked up at call time: a patched isend/irecv (communication accounting) is seen.
    c10d = dist.distributed_c10d
    ops = [dist.P2POp(c10d.isend, send, nxt, group, tag),
           dist.P2POp(c10d.irecv, recv, prev, group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """forward: ring pass of K/V with online softmax; backward: a second ring pass.

    forward: K/V blocks circulate ``cp - 1`` hops; each is folded into the running
    output with the log-sum-exp correction. Saves q, k, v, out and lse (``b x a x n``
    floats), never the ``n x n`` probabilities.
    backward: K/V circulate again together with their dK/dV accumulators (``cp``
    hops, the last one brings each accumulator home); dQ stays local.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool, group: Any) -> torch.Tensor:
        rank, cp = cp_world(group)
        scale = 1.0 / math.sqrt(q.size(-1))
        n = q.size(-2)
        q_pos = positions(n, rank, cp, q.device) if causal else None
        acc = accumulation_dtype(q.dtype)
        o = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # (2, b, a, n, d): one message per hop
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                nxt, works = ring_exchange(kv, group, rank, cp)
            src = (rank - step) % cp
            k_pos = positions(n, src, cp, q.device) if causal else None
            o_b, lse_b = block_forward(q, kv[0], kv[1], q_pos, k_pos, scale)
            o, lse = merge(o, lse, o_b, lse_b)
            if step < cp - 1:
                _wait(works)
                kv = nxt
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # noqa: ANN205
        q, k, v, out, lse = ctx.saved_tensors
        rank, cp = cp_world(ctx.group)
        scale = 1.0 / math.sqrt(q.size(-1))
        n = q.size(-2)
        q_pos = positions(n, rank, cp, q.device) if ctx.causal else None
        acc = accumulation_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (b, a, n)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for step in range(cp):
            if step < cp - 1:
                nxt, works = ring_exchange(kv, ctx.group, rank, cp)
            src = (rank - step) % cp
            k_pos = positions(n, src, cp, q.device) if ctx.causal else None
            dq_b, dk_b, dv_b = block_backward(q, kv[0], kv[1], q_pos, k_pos, scale,
                                              dout, lse, delta)
            dq += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
            if cp > 1:  # the accumulator follows its block; after cp hops it is home
                dkv, dworks = ring_exchange(dkv, ctx.group, rank, cp, tag=1)
                _wait(dworks)
            if step < cp - 1:
                _wait(works)
                kv = nxt
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   causal: bool = True, group: Any = None) -> torch.Tensor:
    """Exact (causal) attention over a sequence sharded across the ranks of ``group``.

    Args:
        q, k, v: this rank's chunks ``[batch, heads, local_seq, head_dim]`` in the
            load-balanced layout of :func:`~dtlib.context_parallel.cp_shard`.
        causal: mask by global position (token t sees tokens 0..t).
        group: the context-parallel process group (``None``: the default group).
    Returns:
        This rank's output chunk ``[batch, heads, local_seq, head_dim]``, equal to the
        matching rows of full attention over the whole sequence.

    Taught in: Chapter 12, "Context parallelism".
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [batch, heads, local_seq, "
                             f"head_dim], got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.size(2) % 2:
        raise ValueError(f"q has local_seq={q.size(2)}; it must be even (two chunks "
                         "per rank: the full sequence divisible by 2 * cp)")
    return RingAttention.apply(q, k, v, causal, group)
