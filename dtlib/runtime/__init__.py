"""The runtime: the world every rank lives in, and starting, watching and stopping
ranks.

- :mod:`~dtlib.runtime.dist`: rank, world size, device and backend, chosen in one place.
- :mod:`~dtlib.runtime.device_memory`: current and peak memory of this rank's device.
- :mod:`~dtlib.runtime.launch`: ``torchrun`` and ``spawn`` from a notebook or a test,
  with timeouts; :mod:`~dtlib.runtime.supervise`, :mod:`~dtlib.runtime.worker` and
  :mod:`~dtlib.runtime.diagnose` do the watching and the hang reports.
- :mod:`~dtlib.runtime.magic`: the ``%%torchrun`` cell magic.

Submodules are imported explicitly (``from dtlib.runtime import dist, launch``) so that
a rank imports only what it uses.
"""
