"""Errors a user can act on.

Library code raises a `UserError` (or a subclass) whose message is one line: what went
wrong, where, and what to do. The CLI prints it and exits with code 2, without a traceback
unless --debug is given. Anything else that escapes is a bug in fa-forensics.
"""


class UserError(Exception):
    """Bad input from the user: one line (what, where, what to do); CLI exit code 2."""


class DumpError(UserError):
    """A dump store is missing, malformed, of an unknown format, or lacks what was asked for."""


class ConfigError(UserError):
    """A replay configuration or an option value is invalid."""


class InvalidSetting(ConfigError):
    """A library setting out of its domain: `.setting` names the field (e.g. "n_sinks"), `.reason` says why.

    The message is in the library's terms; a command maps `.setting` to its own option name.
    """

    def __init__(self, setting: str, reason: str) -> None:
        self.setting, self.reason = setting, reason
        super().__init__(f"{setting}: {reason}")


class OutOfRange(ConfigError):
    """An index (a row, a feature) beyond what the data has: `.what`, `.value`, `.where`, `.limit` (largest valid)."""

    def __init__(self, what: str, value: int, where: str, limit: int) -> None:
        self.what, self.value, self.where, self.limit = what, value, where, limit
        super().__init__(f"{what} {value} is out of range at {where}: {what}s are 0..{limit}")



class BackendUnsupported(ConfigError):
    """A replay backend cannot run what was asked here: `.backend`, `.reason`, and `.alternative`, a backend that
    can."""

    def __init__(self, backend: str, reason: str, alternative: str = "emulate") -> None:
        self.backend, self.reason, self.alternative = backend, reason, alternative
        super().__init__(f"replay: backend {backend} {reason}; backend {alternative} can")


class TargetExists(DumpError, ConfigError):
    """A file or store to be written exists already: `.path`; `.setting` names the destination (e.g. "out", "to");
    `.foreign`: it is not an fa-forensics dump, so it is never replaced."""

    def __init__(self, path, setting: str, foreign: bool = False) -> None:
        self.path, self.setting, self.foreign = path, setting, foreign
        if foreign:
            super().__init__(f"{path} exists and is not an fa-forensics dump; it is never replaced")
        else:
            super().__init__(f"{path} already exists; overwrite=True replaces it")


class TargetUnwritable(DumpError):
    """A file or store cannot be written: `.path`, `.setting` (the destination, e.g. "to"), `.reason` (the OS's)."""

    def __init__(self, path, setting: str, reason: str) -> None:
        self.path, self.setting, self.reason = path, setting, reason
        super().__init__(f"cannot write {path}: {reason}")


class NothingSelected(DumpError):
    """No (step, layer, head) of a dump matches the selection: `.path`, `.step`, `.layer`, `.head` (None = any)."""

    def __init__(self, path, step, layer, head) -> None:
        self.path, self.step, self.layer, self.head = path, step, layer, head
        asked = ", ".join(f"{k} {v}" for k, v in (("step", step), ("layer", layer), ("head", head)) if v is not None)
        super().__init__(f"{path}: nothing matches {asked or 'the selection'}; Dump.select lists what exists")


class NoTimeline(DumpError):
    """A dump without the per-step timeline a monitored capture records."""


class OtherModel(DumpError):
    """A run's model differs from the one whose steps a store holds (`allow_other_model` adds them anyway)."""


class ClusterUnreachable(ConfigError):
    """A Dask cluster could not be started or reached: `.where` (an address or "a local cluster of N
    workers") and `.reason`."""

    def __init__(self, where: str, reason: str) -> None:
        self.where, self.reason = where, reason
        super().__init__(f"cannot start or reach {where}: {reason}")


class UnknownRank(DumpError):
    """A rank a dump does not hold: `.rank`, `.path` and `.ranks` (those it holds)."""

    def __init__(self, rank: int, path, ranks: str) -> None:
        self.rank, self.path, self.ranks = rank, path, ranks
        super().__init__(f"rank {rank} is not in {path} (ranks: {ranks})")


# -- writing in places the tool does not trust (dump/safe_files.py) -----------------------------------------


def _size(n: int | None) -> str:
    """'12.3 MB' (decimal units), '?' when unknown."""
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


class DiskFull(TargetUnwritable):
    """The file system (or the quota) ran out of space writing `.path`: `.needed` bytes (None: unknown),
    `.free` bytes free there (None: unknown). Nothing was left half-written in its place."""

    def __init__(self, path, setting: str, needed: int | None, free: int | None, quota: bool = False) -> None:
        self.needed, self.free, self.quota = needed, free, quota
        what = "the disk quota is exhausted" if quota else "no space left on the device"
        need = f"; it needs about {_size(needed)}" if needed is not None else ""
        super().__init__(path, setting, f"{what} ({_size(free)} free{need}); nothing was left in its place")


class LinkRefused(TargetUnwritable):
    """A path to be written is a symbolic link (`.target` where it points) or a file with other hard links
    (`.target` None): writing there would change a file the user did not name, so it is refused."""

    def __init__(self, path, setting: str, target: str | None) -> None:
        self.target = target
        what = f"it is a symbolic link to {target}" if target is not None else "it is a file with other hard links"
        super().__init__(path, setting, f"{what}, which fa-forensics never writes through")


class SpecialFileRefused(TargetUnwritable):
    """A path to be written is a FIFO, a device or a socket (`.kind`): replacing it with a file would change
    something the user did not name (a root `--json /dev/null` would replace the device)."""

    def __init__(self, path, setting: str, kind: str) -> None:
        self.kind = kind
        super().__init__(path, setting, f"it is {kind}, not a file; fa-forensics writes only regular files")


class ForeignOwnerRefused(TargetUnwritable):
    """A file or folder to be replaced belongs to another user (`.uid`): fa-forensics never replaces it."""

    def __init__(self, path, setting: str, uid: int) -> None:
        self.uid = uid
        super().__init__(path, setting, f"it belongs to another user (uid {uid}), and fa-forensics never replaces "
                                        "another user's file")


class ParentLinkRefused(TargetUnwritable):
    """A folder on the way to a path is a symbolic link (`.link` -> `.target`) that the kernel's protected_symlinks
    rule would not follow: planted by another user (`.uid`) in a sticky world-writable folder."""

    def __init__(self, path, setting: str, link: str, target: str, uid: int) -> None:
        self.link, self.target, self.uid = link, target, uid
        super().__init__(path, setting, f"its folder {link} is a symbolic link to {target} planted by another user "
                                        f"(uid {uid}) in a sticky world-writable folder, which fa-forensics never "
                                        "follows")


class NotReportFolder(TargetUnwritable):
    """`report --out` names a folder holding files no earlier report wrote (`.foreign`: the first few): a report
    replaces only what a report wrote, so it is refused."""

    def __init__(self, path, setting: str, foreign: list[str]) -> None:
        self.foreign = foreign
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        super().__init__(path, setting, f"it holds files no fa-forensics report wrote ({shown}), and a report never "
                                        "deletes what it did not write")


class MissingExtra(UserError):
    """An optional dependency is not installed: `.module`, `.extra` (the package extra that installs it),
    `.needed_for` (what asked for it)."""

    def __init__(self, module: str, extra: str, needed_for: str, reason: str) -> None:
        self.module, self.extra, self.needed_for = module, extra, needed_for
        super().__init__(f"{needed_for} needs {module}, which is not installed ({reason}); "
                         f"install it with: pip install 'fa-forensics[{extra}]'")
