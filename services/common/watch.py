"""Secrets read again when their files change (API keys, certificates), without a restart.

A file's signature is its inode, size and mtime: a file rewritten in place changes its mtime (and
mostly its size), one replaced by a rename (`mv`, what `specd certs` does) or a Kubernetes Secret
volume's update (it swaps a symlink to a new directory) is a new inode. Reading a signature is one
stat per file, cheap enough to do per request or per TLS handshake.
"""

from __future__ import annotations

import os
from pathlib import Path

Signature = tuple[tuple[int, int, int] | None, ...]


def signature(*paths: Path) -> Signature:
    """What changes when any of `paths` is rewritten or replaced (None for one that is missing)."""
    seen = []
    for path in paths:
        try:
            status = os.stat(path)  # follows symlinks: a Secret's file is a link into its current data
        except OSError:
            seen.append(None)
            continue
        seen.append((status.st_ino, status.st_size, status.st_mtime_ns))
    return tuple(seen)
