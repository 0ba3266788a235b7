"""What each chapter's page runs, draws, or reproduces from the seed tutorial.

One package per notebook, named like it: ``chNN_<slug>/runs.py`` (rank functions and
comparisons), ``figures.py`` (matplotlib, imported lazily), ``seed.py`` (the tutorial's
mistakes, reproduced). Techniques live in their own packages; nothing below imports
this.
"""
