"""The small models every chapter reuses: a GPT in the style of nanoGPT, and an MLP.

One family across the book, so numbers compare across chapters: the memory chapter
measures this GPT, the data-parallel and ZeRO chapters train it, the tensor- and
pipeline-parallel chapters split it. Attention is written out (no fused kernel) so that
every tensor the memory formulas count is visible; ``attention="sdpa"`` switches to
``scaled_dot_product_attention`` (Chapter 12), which stores no ``s x s`` tensor.

Taught in: Chapter 1 (memory), used by every later chapter.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.init import replay_init

#: Attention cores of :class:`CausalSelfAttention` (``GPTConfig.attention``).
ATTENTION = ("explicit", "sdpa")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT.

    vocab_size: tokens in the vocabulary (V).
    seq_len: maximum sequence length (s), also the size of the position table.
    n_layers: transformer blocks (l).
    hidden: model width (h); must be divisible by ``n_heads``.
    n_heads: attention heads (a).
    dropout: dropout probability (0 keeps runs bit-for-bit comparable across ranks).
    tie_weights: share the token embedding with the output head, as GPT-2 and the
        Megatron-LM parameter count do.
    attention: ``"explicit"`` writes the ``s x s`` scores, mask and softmax out (every
        term of Chapter 1's activation formula is a tensor); ``"sdpa"`` calls
        ``torch.nn.functional.scaled_dot_product_attention`` (fused; Chapter 12).
    """

    vocab_size: int = 256
    seq_len: int = 64
    n_layers: int = 2
    hidden: int = 64
    n_heads: int = 4
    dropout: float = 0.0
    tie_weights: bool = True
    attention: str = "explicit"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "hidden", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.hidden % self.n_heads:
            raise ValueError(
                f"hidden={self.hidden} must be divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not allowed; "
                             f"allowed: {ATTENTION}")


class CausalSelfAttention(nn.Module):
    """Multi-head attention with a causal mask: token t sees tokens 0..t only.

    The projections live here; the *core* (scores, mask, softmax, dropout, x V) is
    :meth:`core`. Setting ``core_fn`` to a function ``(q, k, v) -> y`` replaces it:
    Chapter 12 checkpoints it (selective recomputation) or sends it round a ring
    (context parallelism) without touching the projections or the parameter names.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attention, self.dropout_p = cfg.attention, cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)
        self.core_fn = None  # optional replacement of self.core

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``(b, heads, s, head_dim)`` q, k, v; same shape out."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=True)
        s = q.size(-2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (b, heads, s, s)
        att = att.masked_fill(~self.mask[:s, :s], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        return att @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # (batch, seq, hidden)
        q, k, v = self.qkv(x).split(h, dim=2)
        # (b, s, h) -> (b, heads, s, h / heads)
        q, k, v = (t.view(b, s, self.n_heads, h // self.n_heads).transpose(1, 2)
                   for t in (q, k, v))
        y = (self.core_fn or self.core)(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.fc_proj = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A decoder-only language model: embeddings, ``n_layers`` blocks, a head.

    ``forward(idx)`` returns logits ``(batch, seq, vocab)``; ``forward(idx, targets)``
    returns ``(logits, loss)`` with the mean cross-entropy over all tokens. ``pos``
    gives each token's position (default ``0 .. seq-1``); a context-parallel rank
    holding chunks of a longer sequence passes their global positions (Chapter 12).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(_init_weights)

    def init_weights(self, seed: int = 0, probe: Any = None) -> None:
        """The values :func:`build_gpt` (``seed``) gives, bit for bit, written into
        this model's parameters wherever they are: built on ``meta``, sharded
        (FSDP2, DTensor TP), then ``to_empty``-ed onto a device.

        The whole build draws each module's default initialisation as it constructs
        it, then GPT-2's re-initialisation module by module; this replays both
        phases one module at a time on the CPU (:func:`dtlib.models.init.replay_init`)
        and keeps each rank's piece, so a rank never holds more than its shards and
        one module's full values. The caller's random state is left untouched.
        ``probe(twin)``, if given, sees each module's full CPU values while they
        exist (to measure a rank's memory during set-up).

        Taught in: Chapter 10, "Refuse what cannot fit".
        """
        if self.cfg.tie_weights and self.head.weight is not self.tok_emb.weight:
            self.head.weight = self.tok_emb.weight  # to_empty allocates each anew
        recipe = meta_gpt(self.cfg)  # its module order = the generator's order
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            replay_init(self, recipe, (_constructed, _reinitialised), probe)
        with torch.no_grad():
            for name, buf in self.named_buffers():
                if name.endswith("mask"):  # the causal masks: recomputed, not drawn
                    buf.copy_(torch.tril(torch.ones_like(buf)))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                pos: torch.Tensor | None = None):
        b, s = idx.shape
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds seq_len={self.cfg.seq_len}")
        if pos is None:
            pos = torch.arange(s, device=idx.device)
        elif pos.shape != (s,):
            raise ValueError(f"pos has shape {tuple(pos.shape)}; it must be ({s},), "
                             "one position per token of idx")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


class MLP(nn.Module):
    """A stack of Linear + GELU layers: the smallest model worth parallelising.

    ``sizes=(16, 64, 64, 8)`` makes three Linear layers 16->64->64->8.
    """

    def __init__(self, sizes: tuple[int, ...] = (16, 64, 64, 8),
                 bias: bool = True) -> None:
        super().__init__()
        if len(sizes) < 2 or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"sizes={sizes!r} must be two or more positive integers")
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias)
                                    for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def _init_weights(module: nn.Module) -> None:
    # GPT-2's scheme: N(0, 0.02) weights, zero biases. A fixed small scale keeps
    # activations O(1) whatever the width (the seed's randn init gives std 1).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _constructed(module: nn.Module) -> bool:
    # what the module's constructor drew (nn.Linear, nn.Embedding, nn.LayerNorm)
    module.reset_parameters()
    return True


def _reinitialised(module: nn.Module) -> bool:
    # what GPT.__init__'s self.apply(_init_weights) then drew (children first: the
    # modules that own parameters come in the same order)
    _init_weights(module)
    return isinstance(module, (nn.Linear, nn.Embedding))


@functools.lru_cache(maxsize=8)
def meta_gpt(cfg: GPTConfig) -> GPT:
    """The GPT of ``cfg`` on the meta device (shapes, no memory), built once per
    configuration: on ``meta`` every initialiser runs through Python
    decompositions, a hundred times slower than the real build of a small model.
    Shared: ``copy.deepcopy`` it before changing it (a copy of meta tensors costs
    nothing).

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return GPT(cfg)


def build_gpt(cfg: GPTConfig | None = None, seed: int = 0) -> GPT:
    """A GPT with weights drawn from ``seed``: every rank that calls this gets the
    same."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg or GPTConfig())


def token_batch(cfg: GPTConfig, batch: int, seed: int = 0,
                device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch ``(idx, targets)`` of shape ``(batch, seq_len)``.

    Targets are the inputs shifted by one, as in language modelling. The same ``seed``
    gives the same batch on every rank, so a test can slice one global batch per rank.
    """
    if batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive integer")
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    return data[:, :-1].to(device), data[:, 1:].to(device)
