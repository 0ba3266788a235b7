"""The DeepSpeed config validator agrees with DeepSpeed on a corpus of configs.

``dtlib.zero.deepspeed_config`` and DeepSpeed's own ``DeepSpeedConfig`` judge the same
configs (``dtlib.zero.deepspeed_corpus``: valid ones, typos, batch mismatches, removed
features, offload at each stage).
Every case where DeepSpeed rejects, we reject too; where only we reject, each of our
reasons is one of the deliberate extra checks listed in ``STRICTER`` (and Chapter 4).
The key lists come from the installed DeepSpeed; the stored snapshot must equal them.
The DeepSpeed half is skipped only where it is not installed (``make test`` installs
it); the snapshot half always runs.
"""

from __future__ import annotations

import importlib.util

import pytest

from dtlib.zero.deepspeed_config import STRICTER, validate_deepspeed_config
from dtlib.zero.deepspeed_corpus import CORPUS
from dtlib.zero.deepspeed_keys import (SNAPSHOT, SNAPSHOT_VERSION, deepspeed_keys,
                                       installed_keys)

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED,
                                     reason="needs the .[deepspeed] extra")



def _ours(cfg: dict, world_size: int, keys: str) -> list[str]:
    """Our error lines ([] when valid)."""
    try:
        validate_deepspeed_config(cfg, world_size, keys=keys)
    except ValueError as err:
        return [line.strip() for line in str(err).splitlines()[1:]]
    return []


def test_corpus_is_large_and_mixed():
    assert len(CORPUS) >= 40
    assert len({name for name, *_ in CORPUS}) == len(CORPUS)
    assert 10 <= sum(ok for *_, ok in CORPUS) <= len(CORPUS) - 10


@pytest.mark.parametrize("name, cfg, world_size, ok", CORPUS,
                         ids=[c[0] for c in CORPUS])
def test_snapshot_verdicts(name, cfg, world_size, ok):
    assert (_ours(cfg, world_size, "snapshot") == []) == ok


@needs_deepspeed
def test_snapshot_equals_the_installed_deepspeed():
    found = installed_keys()
    assert found.version == f"{SNAPSHOT_VERSION} (installed)"  # pinned in CI
    assert deepspeed_keys().version == found.version  # "auto" reads the installed
    for field in ("top", "zero", "offload_param", "offload_optimizer"):
        assert getattr(found, field) == getattr(SNAPSHOT, field), field
    assert set(found.removed) == set(SNAPSHOT.removed)
    assert "amp" not in found.top and "bfloat16" in found.top


@needs_deepspeed
@pytest.mark.parametrize("name, cfg, world_size, ok", CORPUS,
                         ids=[c[0] for c in CORPUS])
def test_agrees_with_deepspeed(name, cfg, world_size, ok):
    from dtlib.zero.deepspeed_keys import deepspeed_accepts

    theirs = deepspeed_accepts(cfg, world_size)
    ours = _ours(cfg, world_size, "installed")
    if theirs is not None:  # DeepSpeed rejects: so must we
        assert ours, f"DeepSpeed rejects {name!r} ({theirs}) but we accept it"
    else:  # DeepSpeed accepts: we may reject only for a listed, deliberate reason
        for line in ours:
            assert any(marker in line for marker in STRICTER), \
                f"we reject {name!r} ({line}) but DeepSpeed accepts it"
    assert (ours == []) == ok
