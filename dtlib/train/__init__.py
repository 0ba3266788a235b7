"""Chapter 10: the capstone training script (``python -m dtlib.train``).

- :mod:`~dtlib.train.config`: the command line as a typed, validated configuration.
- :mod:`~dtlib.train.strategies`: the table from strategy name to the technique's
  Parallelism factory (DDP, FSDP2, FSDP x TP).
- :mod:`~dtlib.train.data`: the synthetic corpus and each rank's next micro-batches.
- :mod:`~dtlib.train.model`: the book's GPT or a Hugging Face Llama.
- :mod:`~dtlib.train.job`: everything a run is made of, built from the configuration.
- :mod:`~dtlib.train.state`: saving and resuming the whole training state.
- :mod:`~dtlib.train.loop`: ``main``: build, resume, and the one loop (``run_steps``).

Nothing is imported here, so ``python -m dtlib.train`` loads each module once.
"""
