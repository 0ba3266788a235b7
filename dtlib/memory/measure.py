"""Measuring memory, so the formulas in ``dtlib.memory`` are checked, not believed.

- :func:`measure_model_states`: bytes of the unique storages behind a model's
  parameters, their gradients and an optimizer's state.
- :func:`measure_activations`: bytes autograd saves for backward during a forward
  pass, seen through ``torch.autograd.graph.saved_tensors_hooks`` and de-duplicated
  by storage; on CUDA also the allocator's peak.
- :func:`gpt_layer_activation_terms`: Korthikanti et al.'s per-layer accounting
  re-derived for one ``dtlib.models`` block at a given dtype, term by term.

Public names are re-exported by ``dtlib.memory``.

Taught in: Chapter 1, measured vs predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from dtlib.models.gpt import build_gpt, token_batch


def _key(t: torch.Tensor) -> tuple[str, int]:
    st = t.untyped_storage()
    return str(t.device), st.data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass(frozen=True)
class ModelStateMeasurement:
    """Bytes of unique storages, by role.

    params: parameter storages (a tied embedding/head counts once).
    grads: gradient storages (``p.grad``).
    optimizer: optimizer state tensors other than step counters (Adam's moments).
    optimizer_steps: per-parameter ``step`` counters (torch Adam keeps one small
        tensor per parameter), reported apart: no formula counts them.
    """

    params: int
    grads: int
    optimizer: int
    optimizer_steps: int

    @property
    def total(self) -> int:
        """All four fields."""
        return self.params + self.grads + self.optimizer + self.optimizer_steps


def measure_model_states(model: nn.Module,
                         optimizer: torch.optim.Optimizer | None = None
                         ) -> ModelStateMeasurement:
    """Bytes of the unique storages of params, grads and optimizer state.

    Call it after a backward and an optimizer step, when gradients and state exist
    (Adam creates its moments lazily, at the first step).

    Args:
        model: any module; parameters sharing a storage are counted once.
        optimizer: its ``state`` tensors are counted; ``None`` counts no state.
    Returns:
        A :class:`ModelStateMeasurement` in bytes.

    Taught in: Chapter 1, measured vs predicted.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={type(optimizer).__name__} must be a "
                         "torch.optim.Optimizer or None")
    seen: set[tuple[str, int]] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            k = _key(t)
            if k not in seen:
                seen.add(k)
                total += _nbytes(t)
        return total

    params = list(model.parameters())
    p_bytes = count(params)
    g_bytes = count(p.grad for p in params if p.grad is not None)
    state = [] if optimizer is None else list(optimizer.state.values())
    steps = count(v for s in state for k, v in s.items()
                  if k == "step" and torch.is_tensor(v))
    o_bytes = count(v for s in state for k, v in s.items()
                    if k != "step" and torch.is_tensor(v))
    return ModelStateMeasurement(p_bytes, g_bytes, o_bytes, steps)


@dataclass(frozen=True)
class ActivationMeasurement:
    """What one forward pass saved for backward, de-duplicated by storage.

    activations: bytes of saved tensors that are neither parameters nor buffers.
    parameters: bytes of parameter storages autograd saved (a Linear keeps its
        weight for the input gradient); they are model states, not activations.
    buffers: bytes of module-buffer storages saved.
    n_saved: saved-tensor references (before de-duplication).
    saved: one ``(kind, shape, dtype, nbytes)`` row per unique storage, in order.
    cuda_peak: on CUDA, ``max_memory_allocated`` during the forward minus the
        allocation before it (activations + temporaries); ``None`` elsewhere.
    """

    activations: int
    parameters: int
    buffers: int
    n_saved: int
    saved: tuple[tuple[str, tuple[int, ...], str, int], ...]
    cuda_peak: int | None = None


def measure_activations(model: nn.Module, *inputs, **kwargs) -> ActivationMeasurement:
    """Run ``model(*inputs, **kwargs)`` once and measure what autograd saves.

    Every tensor autograd packs for backward passes through a
    ``saved_tensors_hooks`` pack hook; views of one storage (q, k and v split from
    one projection) count once, at the storage's size. Parameters and buffers that
    are saved are reported apart: they exist whether or not we train.

    Args:
        model: the module; run in its current mode (``train()`` for dropout).
        *inputs, **kwargs: passed to the model.
    Returns:
        An :class:`ActivationMeasurement`.

    Taught in: Chapter 1, measured vs predicted.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
    param_keys = {_key(p) for p in model.parameters()}
    buffer_keys = {_key(b) for b in model.buffers()}
    rows: dict[tuple[str, int], tuple[str, tuple[int, ...], str, int]] = {}
    n_saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n_saved
        n_saved += 1
        k = _key(t)
        if k not in rows:
            kind = ("parameter" if k in param_keys
                    else "buffer" if k in buffer_keys else "activation")
            rows[k] = (kind, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                       _nbytes(t))
        return t

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        out = model(*inputs, **kwargs)
    peak = None
    if on_cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    del out  # frees the graph and everything it saved
    by_kind = {"activation": 0, "parameter": 0, "buffer": 0}
    for kind, _, _, nbytes in rows.values():
        by_kind[kind] += nbytes
    return ActivationMeasurement(by_kind["activation"], by_kind["parameter"],
                                 by_kind["buffer"], n_saved, tuple(rows.values()),
                                 peak)


def gpt_layer_activation_terms(seq_len: int, micro_batch: int, hidden: int,
                               n_heads: int, *, dtype_bytes: int = 2,
                               dropout: bool = True, mask_bytes: int = 1,
                               attention: str = "explicit") -> dict[str, int]:
    """Bytes one ``dtlib.models.Block`` saves for backward, term by term.

    Korthikanti et al. 2022 §4.1 itemise a layer as 34 sbh + 5 as^2 b bytes with
    16-bit values and 1-byte dropout masks. Here each term is written for
    ``dtype_bytes`` per value and ``mask_bytes`` per dropout-mask element, and with
    ``dropout=False`` the masks and the attention-dropout output vanish (PyTorch
    saves nothing for p = 0). The mask size depends on the kernel: CUDA's fused
    ``native_dropout`` keeps a bool mask (1 byte); on CPU PyTorch multiplies by a
    scaled noise tensor of the input's dtype and saves that (``dtype_bytes``). Two terms
    the paper leaves out are kept, because PyTorch saves them: the layer norms'
    fp32 mean and 1/std (4 x sb x 4 bytes) and the causal mask (s^2 bools, built
    per layer by ``~mask``; the paper's fused softmax masks in the kernel).
    With ``dtype_bytes=2, dropout=True`` the paper's terms sum to sbh(34 + 5as/h).

    ``attention="sdpa"`` is a fused kernel (FlashAttention; on CPU PyTorch's flash
    kernel, which it picks without dropout): no softmax output, attention dropout
    or causal mask is saved, only one fp32 log-sum-exp per head and row (as b x 4
    bytes, a term the paper does not have). With dropout on, PyTorch's CPU SDPA
    falls back to its math kernel, which stores the s x s tensors like "explicit".

    Args:
        seq_len, micro_batch, hidden, n_heads: s, b, h, a (positive integers).
        dtype_bytes: bytes per activation value: 2 (16-bit) or 4 (fp32).
        dropout: whether dropout is active (p > 0 in training mode).
        mask_bytes: bytes per dropout-mask element: 1 (paper, CUDA) or, on CPU,
            ``dtype_bytes``.
        attention: "explicit" (the s x s tensors are saved) or "sdpa" (a fused
            kernel that saves a log-sum-exp instead).
    Returns:
        ``{term: bytes}``; the keys in ``PAPER_OMITS`` are the two terms the paper
        neglects.

    Taught in: Chapter 1, measured vs predicted.
    """
    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch),
                    ("hidden", hidden), ("n_heads", n_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if hidden % n_heads:
        raise ValueError(f"n_heads={n_heads} must divide hidden={hidden}")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes={dtype_bytes!r} must be 2 or 4")
    if mask_bytes not in (1, 2, 4):
        raise ValueError(f"mask_bytes={mask_bytes!r} must be 1, 2 or 4")
    if attention not in ("explicit", "sdpa"):
        raise ValueError(f"attention={attention!r} must be 'explicit' or 'sdpa'")
    s, b, h, a, e = seq_len, micro_batch, hidden, n_heads, dtype_bytes
    sbh, ass = s * b * h, a * s * s * b
    mask = mask_bytes if dropout else 0  # bytes per mask element; 0: no dropout
    terms = {
        "layer-norm inputs (2)": 2 * e * sbh,
        "QKV projection input": e * sbh,
        "Q and K (for QK^T)": 2 * e * sbh,
        "V (for attention x V)": e * sbh,
        "softmax output": e * ass,
        "attention dropout mask + output": (mask + (e if dropout else 0)) * ass,
        "output projection input": e * sbh,
        "dropout masks after attention and MLP": 2 * sbh * mask,
        "MLP first linear input": e * sbh,
        "GELU input (4h wide)": 4 * e * sbh,
        "MLP second linear input (4h wide)": 4 * e * sbh,
        "layer-norm mean and 1/std (fp32)": 2 * 2 * s * b * 4,
        "causal mask (s x s bools)": s * s,
    }
    if attention == "sdpa":
        for name in ("softmax output", "attention dropout mask + output",
                     "causal mask (s x s bools)"):
            del terms[name]
        terms[LOGSUMEXP] = a * s * b * 4
    return terms


LOGSUMEXP = "attention log-sum-exp (fp32, fused kernel)"


PAPER_OMITS = ("layer-norm mean and 1/std (fp32)", "causal mask (s x s bools)",
               LOGSUMEXP)
"""Terms of :func:`gpt_layer_activation_terms` that Korthikanti et al. neglect."""


def measure_gpt_layer(cfg, micro_batch: int, seed: int = 0) -> int:
    """Measured activation bytes of one GPT block: the model with ``cfg.n_layers + 1``
    blocks minus the model with ``cfg.n_layers``, which cancels the embeddings,
    final norm and loss.

    Args:
        cfg: a ``dtlib.models.GPTConfig`` (its ``dropout`` decides the masks).
        micro_batch: sequences per batch.
        seed: weights and batch seed.
    Returns:
        Bytes saved for backward by one block (CPU, fp32, training mode).

    Taught in: Chapter 1, measured vs predicted.
    """
    from dataclasses import replace

    totals = []
    for n_layers in (cfg.n_layers, cfg.n_layers + 1):
        c = replace(cfg, n_layers=n_layers)
        model = build_gpt(c, seed=seed).train()
        idx, targets = token_batch(c, micro_batch, seed=seed)
        totals.append(measure_activations(model, idx, targets).activations)
    return totals[1] - totals[0]
