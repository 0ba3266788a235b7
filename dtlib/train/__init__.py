"""Chapter 10: the capstone training script (``python -m dtlib.train``).

- :mod:`~dtlib.train.config`: the command line as a typed, validated configuration.
- the strategies are the capstone's rows (DDP, FSDP2, FSDP x TP) of the book's one
  table, :mod:`dtlib.planner.strategies`.
- :mod:`~dtlib.train.data`: the samples (synthetic, or windows of a token file), the
  job's sample order (samples consumed) and each rank's next micro-batches;
  ``python -m dtlib.train.data prepare`` writes token files
  (:mod:`~dtlib.train.tokens`).
- :mod:`~dtlib.train.model`: the book's GPT or a Hugging Face Llama.
- :mod:`~dtlib.train.job`: everything a run is made of, built from the configuration.
- :mod:`~dtlib.train.state`: saving and resuming the whole training state, and
  ``--export-hf``.
- :mod:`~dtlib.train.async_save`: ``--async-save``, checkpoints written in the
  background and published once whole.
- :mod:`~dtlib.train.metrics`: what the log says (step time, tokens/s, MFU, peak
  memory, held-out loss), the JSON-lines log and TensorBoard scalars.
- :mod:`~dtlib.train.faults`: preemption signals, a dead rank's rehearsal,
  ``--keep-last``.
- :mod:`~dtlib.train.loop`: ``main``: build, resume, and the one loop (``run_steps``).

Nothing is imported here, so ``python -m dtlib.train`` loads each module once.
"""
