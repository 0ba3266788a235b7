"""``python -m dtlib.train``: the capstone training script (:mod:`dtlib.train.loop`)."""

from dtlib.train.loop import main

if __name__ == "__main__":
    main()
