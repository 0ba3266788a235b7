"""Communication volume of context parallelism: ring (pass K/V) vs all-to-all (Ulysses).

Ring attention moves K and V: every rank sends its K/V block ``cp - 1`` times in the
forward pass, so one rank sends ``2 (cp - 1) b (s/cp) h_kv`` elements per layer, and
the backward pass sends K/V again plus the dK/dV accumulators (``cp`` hops). At a
fixed sequence length that is ``2 b s h_kv (cp - 1)/cp``: it rises from ``b s h_kv``
(cp = 2) toward ``2 b s h_kv``; it grows linearly with ``cp`` only at a fixed piece
``s/cp`` per rank. Each hop hides behind a block of attention compute. An all-gather
of K and V (torch's default rotate method, as Llama 3 trained) sends the same blocks
by the ring algorithm, but holds all of K and V at once. DeepSpeed-Ulysses (Jacobs
et al. 2023) instead re-shards by heads: an all-to-all turns ``(s/cp, all heads)``
into ``(all s, heads/cp)`` for q, k and v, attention runs locally, and one
all-to-all turns the output back. Each all-to-all keeps ``1/cp`` of the tensor and
sends the rest, so a rank sends
``4 b (s/cp) h (cp - 1)/cp`` elements per layer forward (falling as ``1/cp`` at a
fixed sequence, below ``4 b (s/cp) h`` at a fixed piece per rank), but
the heads must divide by ``cp`` and nothing overlaps the all-to-alls.

Taught in: Chapter 12, "Context parallelism".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CPVolume:
    """Bytes one rank sends for one attention layer.

    ring_forward: K/V blocks, ``cp - 1`` hops.
    ring_backward: K/V again (``cp - 1`` hops) plus dK/dV accumulators (``cp`` hops).
    ulysses_forward: all-to-alls of q, k, v (in) and the output (back).
    ulysses_backward: the same four all-to-alls on the gradients.
    """

    ring_forward: int
    ring_backward: int
    ulysses_forward: int
    ulysses_backward: int

    @property
    def allgather_forward(self) -> int:
        """An all-gather of K and V (torch's default rotate method): by the ring
        algorithm each rank sends its block to ``cp - 1`` peers, the ring's bytes."""
        return self.ring_forward


def cp_volume(batch: int, seq_len: int, hidden: int, cp: int, *, n_heads: int,
              n_kv_heads: int | None = None, element_size: int = 4,
              grad_element_size: int = 4) -> CPVolume:
    """Bytes sent by one rank per attention layer, ring attention vs Ulysses.

    Args:
        batch, seq_len, hidden: b, s (the full sequence), h.
        cp: context-parallel group size; ``seq_len`` divisible by ``2 * cp``.
        n_heads: query heads (Ulysses needs them divisible by ``cp``).
        n_kv_heads: key/value heads (grouped-query attention); default ``n_heads``.
        element_size: bytes per element of q, k, v and the output.
        grad_element_size: bytes per element of the dK/dV accumulators the ring sends
            in backward (``ring_attention`` accumulates in
            ``promote_types(float32, input dtype)``: 4 up to float32 inputs, 8 for
            float64).
    Returns:
        A :class:`CPVolume`; the ring numbers are exactly what
        ``ring_attention`` sends (checked against measured bytes in the tests).

    Taught in: Chapter 12, "Context parallelism".
    """
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    for name, value in (("batch", batch), ("seq_len", seq_len), ("hidden", hidden),
                        ("cp", cp), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 * cp = {2 * cp}")
    if hidden % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"hidden={hidden} must divide by n_heads={n_heads}, and "
                         f"n_heads by n_kv_heads={n_kv_heads}")
    local = batch * (seq_len // cp)  # tokens per rank
    kv = 2 * local * hidden * n_kv_heads // n_heads  # K and V elements on one rank
    ring_fwd = (cp - 1) * kv * element_size
    ring_bwd = ring_fwd + (cp * kv * grad_element_size if cp > 1 else 0)
    # q, k, v in and the output back; K/V smaller with GQA
    a2a = (2 * local * hidden + kv) * (cp - 1) // cp
    return CPVolume(ring_fwd, ring_bwd, a2a * element_size, a2a * element_size)
