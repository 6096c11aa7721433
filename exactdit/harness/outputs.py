"""An output folder a run either fills completely or leaves as it was.

A run writes its files into a private temporary folder; only when it has written them all are they
moved into ``--out``, after removing the files an earlier run of the same command left there (an
``ab_report.md`` of another prompt beside a new image). A run that fails or is interrupted (Ctrl-C)
removes its temporary folder and leaves ``--out`` untouched: no empty folder, no half-written set.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable


class HarnessError(RuntimeError):
    """A user-facing error (the CLI prints its message on one line and exits non-zero)."""


def check_writable(out: str | Path, option: str = "--out") -> Path:
    """Refuse, before a slow run, an output folder that cannot be created or written (one line naming
    ``option``); creates nothing. Returns the folder as a Path."""
    if not str(out).strip():
        raise HarnessError(f"{option} is empty; name a folder (. for this one)")
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise HarnessError(f"{option} {path}: is a file, not a folder")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise HarnessError(f"{option} {path}: {existing} is a file, not a folder")
    try:  # the one reliable test (root passes os.access on read-only file systems such as /proc)
        probe = tempfile.mkdtemp(prefix=".exactdit-probe-", dir=existing)
        os.rmdir(probe)
    except OSError as exc:
        raise HarnessError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
    return path


class StagedOutput:
    """``with StagedOutput(out, owned) as o:`` write to ``o.path(name)``, then ``o.commit()``.

    ``owned``: glob patterns of the files this command writes; on commit those already in ``out`` are
    removed first, other files in ``out`` are left alone. ``final(name)`` is where a file ends up."""

    def __init__(self, out: str | Path, owned: Iterable[str], option: str = "--out"):
        self.out = Path(out).expanduser()
        self.owned = tuple(owned)
        self.option = option
        self.stage: Path | None = None

    def __enter__(self) -> "StagedOutput":
        self.stage = Path(tempfile.mkdtemp(prefix="exactdit-out-"))
        return self

    def __exit__(self, *exc) -> None:
        if self.stage is not None:
            shutil.rmtree(self.stage, ignore_errors=True)
            self.stage = None

    def path(self, name: str) -> Path:
        assert self.stage is not None, "StagedOutput used outside its with block"
        return self.stage / name

    def final(self, name: str | Path) -> Path:
        return self.out / Path(name).name

    def commit(self) -> None:
        """Move every staged file into ``out`` (replacing the owned files of an earlier run), all or
        nothing (:func:`replace_in`)."""
        assert self.stage is not None, "StagedOutput used outside its with block"
        old = [f for pattern in self.owned for f in self.out.glob(pattern) if f.is_file() or f.is_symlink()] \
            if self.out.is_dir() else []
        try:
            replace_in(self.out, sorted(self.stage.iterdir()), old)
        except OSError as exc:
            raise HarnessError(f"{self.option} {self.out}: could not write the results "
                               f"({exc.strerror or exc})") from None


def replace_in(out: Path, new: list[Path], old: list[Path]) -> None:
    """Move ``new`` (files or folders) into ``out`` in place of ``old`` (entries of ``out``; and of
    any entry of a new one's name), all or nothing: the new entries first go into a hidden folder
    in ``out`` (a copy where they lie on another file system, while the old set stays whole), the
    old ones are renamed aside, the new ones renamed in. An error or an interrupt (Ctrl-C) on the
    way puts the old entries back and leaves none of the new ones, nor an ``out`` it created."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    old = list(dict.fromkeys([*old, *(out / p.name for p in new)]))
    incoming = aside = None
    set_aside, placed = [], []
    try:
        incoming = Path(tempfile.mkdtemp(prefix=".exactdit-new-", dir=out))
        aside = Path(tempfile.mkdtemp(prefix=".exactdit-old-", dir=out))
        for p in new:
            shutil.move(str(p), str(incoming / p.name))
        for p in old:
            if p.exists() or p.is_symlink():
                p.rename(aside / p.name)
                set_aside.append(p.name)
        for p in new:
            (incoming / p.name).rename(out / p.name)
            placed.append(p.name)
    except BaseException:
        for name in placed:
            _remove(out / name)
        for name in set_aside:
            (aside / name).rename(out / name)
        raise
    finally:
        for folder in (incoming, aside):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
