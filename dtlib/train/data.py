"""The capstone's data: samples, their order, and each rank's next micro-batches.

Two kinds of samples, one interface (``len(data)`` and ``data.rows(indices)`` ->
a ``(k, seq_len + 1)`` tensor of token ids):

- :class:`SyntheticTokens`: a learnable synthetic corpus, the same on every rank and
  every run with the same seed (the default, nothing to prepare);
- :class:`TokenWindows`: windows of ``seq_len + 1`` tokens of a memory-mapped token
  file (``--data DIR``, written by ``python -m dtlib.train.data prepare``, see
  :mod:`dtlib.train.tokens`), its last ``eval_fraction`` held out for evaluation.

:class:`GlobalSampler` is the order: one seeded permutation per epoch, and one
number, the samples consumed by the whole job (Megatron's
``consumed_train_samples``). A step of global batch ``B`` reads positions
``consumed .. consumed + B`` of that order, dealt to the data-parallel ranks as
``DistributedSampler`` deals them; the position does not depend on the world size, so
the same checkpoint resumes on any number of ranks, and a micro-batch costs
O(micro_batch) (the permutation is computed once per epoch, not per micro-batch).
:func:`step_batches` is what the training loop calls once per optimizer step.

Taught in: Chapter 10, "The script's structure" and "Real token files".
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

import numpy as np
import torch

from dtlib.train.tokens import load_tokenizer, open_tokens, prepare

__all__ = ["SyntheticTokens", "TokenWindows", "GlobalSampler", "step_batches",
           "held_out_split", "open_split", "main"]

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (idx, targets), (micro_batch, seq)


class SyntheticTokens(torch.utils.data.Dataset):
    """Deterministic sequences ``x[t+1] = (5 x[t] + 3) mod V`` with 10% random tokens.

    Learnable (the loss falls well below ln V) and the same on every rank and every
    run with the same seed, so runs of different world sizes see the same data.

    Args:
        n: samples; seq_len: tokens per sample (inputs; targets are shifted by one);
        vocab_size: tokens in the vocabulary; seed: the generator's seed.

    Taught in: Chapter 10, "The script's structure".
    """

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        for name, value in (("n", n), ("seq_len", seq_len), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        g = torch.Generator().manual_seed(seed)
        data = torch.empty(n, seq_len + 1, dtype=torch.long)
        data[:, 0] = torch.randint(0, vocab_size, (n,), generator=g)
        for t in range(seq_len):
            data[:, t + 1] = (5 * data[:, t] + 3) % vocab_size
        noise = torch.rand(n, seq_len + 1, generator=g) < 0.1
        data[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=g)
        self.data = data  # (n, seq_len + 1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> MicroBatch:
        return self.data[i, :-1], self.data[i, 1:]

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Samples ``indices`` as one ``(len(indices), seq_len + 1)`` tensor."""
        return self.data[indices]


class TokenWindows:
    """Samples of a token file: window ``i`` is tokens ``[i s, i s + s + 1)`` (``s``:
    ``seq_len``), so inputs tile the file and the targets are the inputs shifted by
    one; windows ``[first, first + n)`` of them (a split).

    Args:
        tokens: the memory-mapped token ids (:func:`dtlib.train.tokens.open_tokens`).
        seq_len: tokens per sample; first, n: the split's windows (None: all).

    Taught in: Chapter 10, "Real token files".
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int = 0,
                 n: int | None = None) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        total = (len(tokens) - 1) // seq_len
        if total < 1:
            raise ValueError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens; "
                             f"the file has {len(tokens)}")
        self.first, self.n = first, total - first if n is None else n
        if not (0 <= first and 0 <= self.n and first + self.n <= total):
            raise ValueError(f"windows [{first}, {first + self.n}) are outside the "
                             f"file's {total}")

    @staticmethod
    def count(n_tokens: int, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens in a file of ``n_tokens``."""
        return (n_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Windows ``indices`` (of this split): reads only their pages of the file."""
        starts = (indices.numpy() + self.first) * self.seq_len
        span = np.arange(self.seq_len + 1)
        return torch.from_numpy(self.tokens[starts[:, None] + span].astype(np.int64))


def held_out_split(n_windows: int, eval_fraction: float) -> tuple[int, int]:
    """(training windows, held-out windows): the last ``eval_fraction`` of the file,
    at least one window when ``eval_fraction > 0``.

    Taught in: Chapter 10, "Real token files".
    """
    held = 0 if eval_fraction == 0 else max(1, int(n_windows * eval_fraction))
    if n_windows - held < 1:
        raise ValueError(f"eval_fraction={eval_fraction} leaves no training window "
                         f"of the file's {n_windows}")
    return n_windows - held, held


class GlobalSampler:
    """The job's sample order: position ``p`` of the run reads sample
    ``perm_e[p mod N]`` of epoch ``e = p // N``, ``perm_e`` a permutation seeded
    with ``seed + e`` (``torch.randperm``, as ``DistributedSampler`` shuffles).

    The state is one integer, ``consumed``: the samples the whole job has read. It is
    the same on every rank and independent of the world size; an epoch's permutation
    is computed once, when the first position of that epoch is asked for.

    Taught in: Chapter 10, "Real token files".
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive integer")
        self.n, self.seed, self.consumed = n, seed, 0
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 1:  # keep this epoch's and the next
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        return self._perms[epoch]

    def indices(self, positions: torch.Tensor) -> torch.Tensor:
        """The samples at run positions ``positions`` (int64)."""
        epochs, offsets = positions // self.n, positions % self.n
        out = torch.empty_like(positions)
        for e in torch.unique(epochs).tolist():
            mine = epochs == e
            out[mine] = self._perm(e)[offsets[mine]]
        return out

    def state_dict(self) -> dict[str, int]:
        """``{"consumed", "seed", "n"}``: enough to continue on any world size."""
        return {"consumed": self.consumed, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``'s position (its seed and sample count must agree)."""
        for key in ("seed", "n"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"the checkpoint's sampler has {key}="
                                 f"{state.get(key)!r}, this job {getattr(self, key)}")
        self.consumed = int(state["consumed"])


def step_batches(data, sampler: GlobalSampler, micro_batch: int, accum_steps: int,
                 dp_rank: int, dp: int, device: torch.device
                 ) -> Callable[[int], list[MicroBatch]]:
    """``batch_fn`` for :func:`dtlib.models.run.run_steps` (``local=True``): each call
    returns this rank's next ``accum_steps`` micro-batches and advances the sampler
    by one global batch (``micro_batch x accum_steps x dp``).

    Micro-batch ``k`` of data-parallel rank ``r`` holds positions ``consumed +
    (k micro_batch + j) dp + r``, ``j < micro_batch``: the ranks' shards are
    ``DistributedSampler``'s, and a step's global batch is the same set of samples
    for any ``dp`` x ``accum_steps`` of the same product. The step number is not
    used: ``sampler.consumed`` *is* the data state, saved with the checkpoint.

    Taught in: Chapter 10, "The script's structure".
    """
    if micro_batch > len(data):
        raise ValueError(f"micro_batch={micro_batch} exceeds the {len(data)} samples; "
                         "allowed: <= that")
    offsets = torch.arange(micro_batch) * dp + dp_rank

    def batch_fn(step: int) -> list[MicroBatch]:
        out = []
        for k in range(accum_steps):
            first = sampler.consumed + k * micro_batch * dp
            rows = data.rows(sampler.indices(first + offsets))
            out.append((rows[:, :-1].to(device), rows[:, 1:].to(device)))
        sampler.consumed += micro_batch * accum_steps * dp
        return out
    return batch_fn


def main(argv: Sequence[str] | None = None) -> dict:
    """``python -m dtlib.train.data prepare TEXT_FILES... --tokenizer bytes|DIR
    --out DIR``: tokenize text files into a token file (:mod:`dtlib.train.tokens`).

    Returns:
        The metadata written (``meta.json``).

    Taught in: Chapter 10, "Real token files".
    """
    parser = argparse.ArgumentParser(
        prog="python -m dtlib.train.data",
        description="Tokenize text files into a memory-mapped token file for "
                    "`python -m dtlib.train --data DIR`.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="text files -> DIR/tokens.bin + meta.json")
    p.add_argument("files", nargs="+", help="text files or glob patterns "
                   "('dtlib/**/*.py' recurses)")
    p.add_argument("--tokenizer", required=True, help="'bytes' (256 byte values, "
                   "nothing downloaded) or a local Hugging Face tokenizer directory")
    p.add_argument("--out", required=True, help="the directory to write (refused "
                   "when it already holds a token file, unless --force)")
    p.add_argument("--force", action="store_true", help="replace the token file "
                   "--out already holds")
    ns = parser.parse_args(argv)
    try:
        meta = prepare(ns.files, load_tokenizer(ns.tokenizer), ns.out, ns.force)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"{ns.out}: {meta['n_tokens']:,} tokens ({meta['dtype']}, vocabulary "
          f"{meta['vocab_size']:,}) from {meta['documents']} files")
    return meta


def open_split(directory: str, seq_len: int, eval_fraction: float
               ) -> tuple[TokenWindows, TokenWindows | None, dict]:
    """(training windows, held-out windows or None, metadata) of a token file.

    Taught in: Chapter 10, "Real token files".
    """
    tokens, meta = open_tokens(directory)
    train_n, held = held_out_split(TokenWindows.count(len(tokens), seq_len),
                                   eval_fraction)
    held_out = TokenWindows(tokens, seq_len, train_n, held) if held else None
    return TokenWindows(tokens, seq_len, 0, train_n), held_out, meta


if __name__ == "__main__":
    main(sys.argv[1:])
