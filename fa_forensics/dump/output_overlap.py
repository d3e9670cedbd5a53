"""An output never lands in an input: the one check every path a command writes goes through.

`info DUMP --json DUMP/zarr.json` would replace the dump's own description with a JSON result; `export DUMP --to
DUMP/step_000000001/layer_000/o/c/0/0/0/0 --overwrite` would replace a chunk; `report DUMP --out DUMP/figures`
would add a folder to the evidence. Each is refused before any work, whichever way the output names the input:

- through symbolic links or `..` (the output's path is resolved as the kernel would resolve it),
- through another mount of the same folder (folders are compared by device and inode, never by name),
- through a hard link (an existing output file with several links is compared, by device and inode, with every
  file of the input),
- and, for an output that is replaced whole (a new store, a report folder, an exported file), the other way round:
  an input inside it would be deleted when it is replaced.

`overlap(output, input_, replaced)` says why writing `output` would change `input_` (None when it would not).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from fa_forensics.dump.safe_read import StrPath

# Files of an input compared with a hard-linked output before the search gives up and refuses it (a dump's
# files are its folders' metadata and its chunks; a store of a million chunks is scanned in about a second).
MAX_SCANNED = 4_000_000


def _identity(path: StrPath) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _ancestors(path: str) -> list[str]:
    """`path` (already resolved) and each folder above it, nearest first."""
    chain = [path]
    while True:
        parent = os.path.dirname(chain[-1])
        if parent == chain[-1]:
            return chain
        chain.append(parent)


def _inside(inner: StrPath, outer_id: tuple[int, int]) -> str | None:
    """The resolved path of `inner` or of its nearest folder whose identity is `outer_id` (None: none is)."""
    resolved = os.path.realpath(inner)
    for candidate in _ancestors(resolved):
        if _identity(candidate) == outer_id:
            return candidate
    return None


def _hard_link_of(output: Path, folder: Path) -> str | None:
    """The file of `folder` (searched without following links) that `output` is another name of, if any."""
    try:
        st = os.lstat(output)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
        return None
    seen = 0
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in (*files, *dirs):
            seen += 1
            path = os.path.join(top, name)
            try:
                other = os.lstat(path)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return path
        if seen > MAX_SCANNED:
            return f"a file of {folder} (it holds too many files to say which)"
    return None


def overlap(output: StrPath, input_: StrPath, *, replaced: bool = False) -> str | None:
    """Why writing `output` would change `input_` ('it is X', 'it lies inside X', ...), None when it would not.

    `replaced`: the output is replaced whole (a store, a report folder, an exported file), so an input inside it
    would be deleted too. Where `input_` does not exist yet (an output replaced whole, not yet written), the
    resolved paths are compared."""
    input_id = _identity(input_)
    if input_id is None:
        inner, outer = os.path.realpath(output), os.path.realpath(input_)
        if inner == outer:
            return f"it is {input_} itself"
        return f"it lies inside {input_}" if inner.startswith(outer.rstrip(os.sep) + os.sep) else None
    input_path = Path(input_)
    is_folder = os.path.isdir(input_)
    where = _inside(output, input_id)
    if where is not None:
        if os.path.realpath(output) == where:
            return f"it is {input_path} itself"
        return f"it lies inside {input_path}"
    output_path = Path(output)
    if is_folder:
        linked = _hard_link_of(output_path, input_path)
        if linked is not None:
            return f"it is another name (a hard link) of {linked}, a file of {input_path}"
    output_id = _identity(output)
    if replaced and output_id is not None and _inside(input_, output_id) is not None:
        return f"{input_path} lies inside it and would be deleted when it is replaced"
    return None
