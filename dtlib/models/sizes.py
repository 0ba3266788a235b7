"""Named model sizes: one registry, so every chapter's "tiny GPT" is the same model.

Taught in: used by every chapter; the numbers compare across chapters because the
models do.
"""

from __future__ import annotations

from dtlib.models.gpt import GPTConfig

__all__ = ["SIZES", "size"]

#: name -> configuration. Each is small enough for 4 gloo ranks on two CPU cores.
SIZES: dict[str, GPTConfig] = {
    # Chapters 3, 5, 8: data and tensor parallel proofs (4 heads divide by tp = 2, 4).
    "tiny": GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4),
    # Chapter 9: the model whose run is killed and resumed (dropout exercises RNG
    # state).
    "tiny-dropout": GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32,
                              n_heads=2, dropout=0.1),
    # Chapter 9, sharded checkpoints: untied head, so every parameter is one DTensor.
    "tiny-untied": GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32,
                             n_heads=2, tie_weights=False),
    # Chapter 6: eight blocks to cut into 2 and 4 pipeline stages (untied head).
    "pipeline": GPTConfig(vocab_size=256, seq_len=32, n_layers=8, hidden=64,
                          n_heads=4, tie_weights=False),
    # Benchmarks of Chapter 3: large enough that communication is measurable.
    "bench-ddp": GPTConfig(vocab_size=256, seq_len=64, n_layers=4, hidden=448,
                           n_heads=8),
}


def size(name: str) -> GPTConfig:
    """The configuration registered as ``name`` (see :data:`SIZES`)."""
    if name not in SIZES:
        raise ValueError(f"size={name!r} is not a registered model size; "
                         f"allowed: {sorted(SIZES)}")
    return SIZES[name]
