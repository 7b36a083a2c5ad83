"""Output paths checked before any work starts: a run that trains, profiles or simulates for
minutes must not fail at its first write with a traceback (``--save``, ``--log-json``, the
simulator's ``--trace`` / ``--png`` / ``--csv``, the profiler's ``--out``).

Writability is tested by making and removing a directory, not by permission bits: as root those
say yes in read-only places (/proc, a read-only mount)."""
from __future__ import annotations

import os
import tempfile

from megatron_oases.errors import ConfigError


def can_create_in(directory: str) -> bool:
    """Whether a directory can be made in ``directory`` (made and removed again to find out)."""
    if not os.path.isdir(directory):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=directory))
    except OSError:
        return False
    return True


def check_output_file(flag: str, path: str | None) -> None:
    """``flag``'s file ``path`` can be written: an existing file opens for writing (``/dev/null``
    too), a new one's folder exists and takes new files; the path is not a directory. One line
    naming the flag otherwise."""
    if path is None or path == "-":
        return
    if not path:
        raise ConfigError(f"{flag} is an empty path; give a file name")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give a file name")
    if os.path.exists(path):  # an existing file (or /dev/null, /dev/stdout): open it as the run will
        try:
            open(path, "a", encoding="utf-8").close()
        except OSError as e:
            raise ConfigError(f"{flag} {path} cannot be written ({e.strerror or e}); pick another path") from None
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: directory {folder} does not exist; create it or pick another path")
    if not can_create_in(folder):
        raise ConfigError(f"{flag} {path}: {folder} is not a writable directory; pick another path")


def check_output_root(flag: str, path: str | None) -> None:
    """``flag``'s directory ``path`` (made by the run where missing, as ``--save`` is) can be made
    or written: its nearest existing ancestor is a writable directory."""
    if path is None:
        return
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not can_create_in(parent):
        raise ConfigError(f"{flag} {path}: {parent} is not a writable directory; pick another path")
