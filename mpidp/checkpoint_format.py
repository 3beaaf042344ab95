"""A checkpoint's files on disk: the directory's name, the manifest, whole-or-absent discovery.

The format ``mpidp.checkpoint.Checkpointer`` writes (its module docstring says what each
file holds and how a save commits); ``latest_checkpoint`` is re-exported there.
"""

from __future__ import annotations

import json
import os
import re

import torch

__all__ = ["FORMAT", "MANIFEST", "NAME", "directory_of", "fsync_file", "latest_checkpoint", "load",
           "write"]

FORMAT = "mpidp.Checkpointer/1"
MANIFEST = "manifest.json"
NAME = re.compile(r"step-(\d{9})$")


def directory_of(step: int) -> str:
    """The name of step ``step``'s checkpoint directory: ``step-000000120``."""
    return f"step-{step:09d}"


def latest_checkpoint(directory: str) -> tuple[str, dict] | None:
    """The newest whole checkpoint under ``directory`` and its manifest, or None (local).

    Whole: a ``step-*`` directory with a readable manifest whose files all exist
    at the sizes it lists; ``.partial-*`` directories and anything else are skipped.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    for name in sorted((n for n in names if NAME.match(n)), reverse=True):
        path = os.path.join(directory, name)
        try:
            with open(os.path.join(path, MANIFEST)) as file:
                manifest = json.load(file)
            whole = (manifest.get("format") == FORMAT and manifest.get("files") and all(
                os.path.getsize(os.path.join(path, f)) == size
                for f, size in manifest["files"].items()))
        except (OSError, ValueError, AttributeError):
            whole = False
        if whole:
            return path, manifest
    return None


def write(path: str, obj) -> None:
    """``torch.save`` ``obj`` to ``path``, flushed and fsynced before it returns."""
    with open(path, "wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())


def fsync_file(path: str) -> None:
    """fsync ``path``, a file or a directory (a rename in it is then durable)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def load(path: str):
    """A file ``write`` wrote, onto the CPU (``weights_only``: no code runs)."""
    return torch.load(path, map_location="cpu", weights_only=True)
