"""Chapter 10: the capstone training script (``python -m dtlib.train``).

- :mod:`~dtlib.train.config`: the command line as a typed, validated configuration.
- :mod:`~dtlib.train.state`: saving and resuming the whole training state.
- :mod:`~dtlib.train.loop`: the training loop (DDP or FSDP2, precision, accumulation).

Nothing is imported here, so ``python -m dtlib.train`` loads each module once.
"""
