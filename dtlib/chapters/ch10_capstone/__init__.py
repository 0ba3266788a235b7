"""Page code of Chapter 10, the capstone: the script's runs a cell launches.

- :mod:`~dtlib.chapters.ch10_capstone.runs`: several runs of ``python -m dtlib.train``
  on ranks that :func:`dtlib.runtime.launch.spawn` started.
"""
