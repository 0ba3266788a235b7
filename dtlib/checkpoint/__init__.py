"""Chapter 9: checkpoints of the whole training state, and resuming exactly.

- :mod:`~dtlib.checkpoint.state`: atomic saves, safe loads, RNG state (the resumable
  sampler lives with the other samplers, :mod:`dtlib.data_parallel.sampling`).
- :mod:`~dtlib.checkpoint.sharded`: one file per rank, resharded on load (paired with
  ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

from dtlib.checkpoint.state import (CHECKPOINT_PATTERN, checkpoint_path,
                                    list_checkpoints, latest_checkpoint, atomic_save,
                                    rng_state, set_rng_state, STATE_KEYS,
                                    save_checkpoint, load_checkpoint)
from dtlib.checkpoint.sharded import (flatten, state_bytes, save_sharded, load_sharded,
                                      load_full, dcp_load_full)

__all__ = ["CHECKPOINT_PATTERN", "checkpoint_path", "list_checkpoints",
           "latest_checkpoint", "atomic_save", "rng_state", "set_rng_state",
           "STATE_KEYS", "save_checkpoint", "load_checkpoint",
           "flatten", "state_bytes", "save_sharded", "load_sharded", "load_full",
           "dcp_load_full"]
