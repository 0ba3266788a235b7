"""Gradient compression as a DDP communication hook: 16-bit gradients.

:func:`low_precision_hook` casts the bucket to bfloat16 or float16, all-reduces it and
casts it back: half the bytes of fp32, every element rounded to 8 or 11 bits. It is
torch's ``bf16_compress_hook``/``fp16_compress_hook`` written out (the tests prove the
two train the same model bit for bit), for either DDP of the book, as
:mod:`dtlib.low_comm.powersgd` is.

Taught in: Chapter 15, "Fewer bits per gradient".
"""

# No ``from __future__ import annotations``: torch DDP's register_comm_hook reads a
# hook's annotations and accepts only the real dist.GradBucket and
# torch.futures.Future[torch.Tensor], not their names as strings.

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LowPrecisionState", "low_precision_hook"]


@dataclass
class LowPrecisionState:
    """What :func:`low_precision_hook` needs: the dtype on the wire and the group.

    Args:
        dtype: ``torch.bfloat16`` (fp32's range, 8 bits of precision) or
            ``torch.float16`` (11 bits, but values under 6e-5 lose bits and over
            65504 overflow).
        group: the data-parallel process group (default: the whole world).

    Taught in: Chapter 15, "Fewer bits per gradient".
    """

    dtype: torch.dtype = torch.bfloat16
    group: Any = None

    def __post_init__(self) -> None:
        allowed = (torch.bfloat16, torch.float16)
        if self.dtype not in allowed:
            raise ValueError(f"LowPrecisionState(dtype={self.dtype!r}): must be one "
                             f"of {allowed}")


def low_precision_hook(state: LowPrecisionState, bucket: dist.GradBucket
                       ) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to ``state.dtype``, divide by the world size, all-reduce
    (sum), cast back into the bucket's buffer: half the bytes of fp32.

    Dividing first keeps float16's sum of ``N`` ranks from overflowing; the
    division by a power of two is exact (above float16's subnormals).

    Taught in: Chapter 15, "Fewer bits per gradient".
    """
    buffer = bucket.buffer()
    small = buffer.to(state.dtype).div_(dist.get_world_size(state.group))
    work = dist.all_reduce(small, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))
