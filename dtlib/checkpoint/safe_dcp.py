"""Loading ``torch.distributed.checkpoint`` directories without running their pickles.

A DCP directory holds ``.metadata`` (a *pickle* of where every tensor sits) and
``__r_k.distcp`` data files, whose non-tensor entries (an optimizer's betas, a step
count saved as a number) are pickles too. ``dcp.load`` unpickles both with plain
``pickle``: a crafted ``.metadata`` in a checkpoint directory runs code on every rank
that resumes from it. Two defences, used together:

- **Restricted unpickling.** :class:`SafeFileSystemReader` reads ``.metadata`` with an
  unpickler that only builds DCP's own metadata classes, ``torch.Size``, dtypes and
  paths, and refuses any other global (``os.system``, ``builtins.eval``, ...);
  :class:`SafeLoadPlanner` reads the non-tensor entries with
  ``torch.load(weights_only=True)``, as the tensors already are.
- **A manifest.** After a save, rank 0 writes ``manifest.json``: the SHA-256 of every
  file, the world size and the step (:func:`write_manifest`). Before a load,
  :func:`verify_manifest` refuses a directory whose manifest is missing or whose files
  differ from it: a truncated or damaged checkpoint is detected before any byte of it
  is used, and the caller can fall back to an older one.

Taught in: Chapter 9, "Safe loads".
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["MANIFEST", "CheckpointDamaged", "write_manifest", "verify_manifest",
           "SafeFileSystemReader", "SafeLoadPlanner", "safe_dcp_load", "file_sha256"]

MANIFEST = "manifest.json"


class CheckpointDamaged(ValueError):
    """A checkpoint that must not be loaded: manifest missing, or a file differs."""


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks: what the manifest
    records per file.

    Taught in: Chapter 9, "Safe loads".
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(ckpt_dir: str) -> list[str]:
    """Every file under ``ckpt_dir`` but the manifest, relative, sorted."""
    out = []
    for root, _, names in os.walk(ckpt_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), ckpt_dir)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(ckpt_dir: str, **info: Any) -> str:
    """Hash every file of a finished checkpoint into ``ckpt_dir/manifest.json``.

    Call it on one rank after every rank has written (after a barrier).

    Args:
        ckpt_dir: the checkpoint directory.
        **info: plain values to record beside the hashes (``world_size``, ``step``).
    Returns:
        The manifest's path.

    Taught in: Chapter 9, "Safe loads".
    """
    manifest = {**info, "files": {rel: file_sha256(os.path.join(ckpt_dir, rel))
                                  for rel in _files(ckpt_dir)}}
    path = os.path.join(ckpt_dir, MANIFEST)
    with open(path + ".part", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)
    return path


def verify_manifest(ckpt_dir: str) -> dict[str, Any]:
    """Check every file of ``ckpt_dir`` against its manifest.

    Returns:
        The manifest (its recorded info and hashes).
    Raises:
        CheckpointDamaged: no manifest, an unreadable one, or a file missing, added
            or changed since the save.

    Taught in: Chapter 9, "Safe loads".
    """
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        recorded = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointDamaged(f"{ckpt_dir}: no readable {MANIFEST} ({exc}); "
                                "refusing to load it") from None
    present = _files(ckpt_dir)
    if sorted(recorded) != present:
        extra = sorted(set(present) - set(recorded))
        missing = sorted(set(recorded) - set(present))
        raise CheckpointDamaged(f"{ckpt_dir}: files differ from {MANIFEST} (missing "
                                f"{missing}, not in it {extra}); refusing to load it")
    for rel, digest in recorded.items():
        if file_sha256(os.path.join(ckpt_dir, rel)) != digest:
            raise CheckpointDamaged(f"{ckpt_dir}: {rel} changed since it was saved "
                                    "(SHA-256 differs from the manifest); refusing "
                                    "to load it")
    return manifest


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP metadata contains; any other global raises."""

    _MODULES = {"torch.distributed.checkpoint.metadata",
                "torch.distributed.checkpoint.filesystem"}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES and not name.startswith("__"):
            obj = getattr(__import__(module, fromlist=[name]), name)
            if isinstance(obj, type):  # dataclasses and enums, no functions
                return obj
        if module == "torch" and (name == "Size" or
                                  isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            from torch.serialization import _get_layout
            return _get_layout  # maps a layout's name to torch.strided etc.
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath",
                                            "PureWindowsPath", "Path"):
            import pathlib
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict
            return OrderedDict
        raise pickle.UnpicklingError(
            f"DCP metadata may not refer to {module}.{name}; refusing to load it "
            "(only checkpoint metadata classes, torch.Size, dtypes and paths)")


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler.

    Taught in: Chapter 9, "Safe loads".
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, "
                                         "not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor entries with ``weights_only=True``.

    Taught in: Chapter 9, "Safe loads".
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict,
                        self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state: dict[str, Any], ckpt_dir: str, no_dist: bool = False
                  ) -> dict[str, Any]:
    """``dcp.load`` into ``state`` after :func:`verify_manifest`, with no pickle run.

    Args:
        state: the state dict to fill in place (as for ``dcp.load``).
        ckpt_dir: a DCP directory written with a :func:`write_manifest` manifest.
        no_dist: load in one process, without a process group.
    Returns:
        The manifest.

    Taught in: Chapter 9, "Safe loads".
    """
    manifest = verify_manifest(ckpt_dir)
    reader = SafeFileSystemReader(ckpt_dir)
    try:  # read once here, so a refusal is a plain error (DCP would wrap it)
        reader.read_metadata()
    except pickle.UnpicklingError as exc:
        raise CheckpointDamaged(f"{ckpt_dir}/.metadata: {exc}") from None
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    return manifest
