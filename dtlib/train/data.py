"""The capstone's data: a learnable synthetic corpus and each rank's next micro-batches.

:class:`SyntheticTokens` is the same on every rank and every run with the same seed;
:class:`~dtlib.data_parallel.sampling.ResumableSampler` (Chapters 3 and 9) cuts it
into data-parallel shards and remembers its position, so a resumed job reads on from
the next sample. :func:`step_batches` is what the training loop calls once per
optimizer step: this rank's ``accum_steps`` micro-batches, on the world's device.

Taught in: Chapter 10, "The script's structure".
"""

from __future__ import annotations

from typing import Callable

import torch

from dtlib.data_parallel.sampling import ResumableSampler

__all__ = ["SyntheticTokens", "next_micro_batch", "step_batches"]

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


def next_micro_batch(data: SyntheticTokens, sampler: ResumableSampler,
                     micro_batch: int, device: torch.device) -> MicroBatch:
    """The next ``micro_batch`` samples of this rank; a new epoch when one runs out.

    Args:
        data: the dataset; sampler: this rank's (resumable) sampler;
        micro_batch: samples to take; device: where the tensors go.
    Returns:
        ``(idx, targets)`` of shape ``(micro_batch, seq_len)``.

    Taught in: Chapter 10, "The script's structure".
    """
    if micro_batch > sampler.num_samples:
        raise ValueError(f"micro_batch={micro_batch} exceeds the {sampler.num_samples} "
                         "samples of this rank's epoch; allowed: <= that")
    if len(sampler) < micro_batch:  # drop the ragged end, like drop_last=True
        sampler.set_epoch(sampler.epoch + 1)
    it = iter(sampler)  # starts at sampler.position: resumable mid-epoch
    rows = data.data[[next(it) for _ in range(micro_batch)]]
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def step_batches(data: SyntheticTokens, sampler: ResumableSampler, micro_batch: int,
                 accum_steps: int, device: torch.device
                 ) -> Callable[[int], list[MicroBatch]]:
    """``batch_fn`` for :func:`dtlib.models.run.run_steps` (``local=True``): each call
    returns this rank's next ``accum_steps`` micro-batches.

    The step number is not used: the sampler's position *is* the data state, saved
    and restored with the checkpoint.

    Taught in: Chapter 10, "The script's structure".
    """
    def batch_fn(step: int) -> list[MicroBatch]:
        return [next_micro_batch(data, sampler, micro_batch, device)
                for _ in range(accum_steps)]
    return batch_fn
