"""``python -m dtlib.train``: run the capstone training script (see :mod:`dtlib.train.loop`)."""

from dtlib.train.loop import main

if __name__ == "__main__":
    main()
