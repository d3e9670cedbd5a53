"""How the CLI words the library's typed errors: the facts come from the library, the option
that acts on them from here (as huggingface_hub's CLI does for its library's errors)."""
from __future__ import annotations

from fa_forensics.errors import (
    BackendUnsupported, ClusterUnreachable, DiskFull, ForeignOwnerRefused, InvalidSetting, LinkRefused, NoTimeline,
    NothingSelected, NotReportFolder, OtherModel, ParentLinkRefused, SpecialFileRefused, TargetExists,
    TargetUnwritable, UnknownRank, UserError,
)


def option(setting: str) -> str:
    """The command-line option of a library setting of the same name ("head_dim" -> "--head-dim")."""
    return "--" + setting.replace("_", "-")


# Errors whose line is the library's message followed by the options that act on it.
_ADVICE = {
    UnknownRank: "pick one of those with --rank",
    OtherModel: "write to another path, or pass --allow-other-model to add its steps anyway",
    ClusterUnreachable: "check --scheduler ADDRESS or use --workers 1",
}


def cli_line(exc: UserError) -> str:
    """The one line `run_cli` prints for a library error."""
    for kind, advice in _ADVICE.items():
        if isinstance(exc, kind):
            return f"{exc}; {advice}"
    if isinstance(exc, BackendUnsupported):
        return f"replay: backend {exc.backend} {exc.reason}; use --backend {exc.alternative}"
    if isinstance(exc, TargetExists):
        if exc.foreign:
            return (f"{exc.path} exists and is not an fa-forensics dump; refusing to overwrite it, choose another "
                    f"{option(exc.setting)}")
        return f"{exc.path} already exists; pass --overwrite to replace it or choose another {option(exc.setting)}"
    if isinstance(exc, DiskFull):
        return f"{exc}; free space there or choose another {option(exc.setting)}"
    if isinstance(exc, (LinkRefused, ParentLinkRefused)):
        return f"{exc}; remove the link or choose another {option(exc.setting)}"
    if isinstance(exc, SpecialFileRefused):
        stdout = " (- writes to the standard output)" if exc.setting == "json" else ""
        return f"{exc}; choose a file name for {option(exc.setting)}{stdout}"
    if isinstance(exc, ForeignOwnerRefused):
        return f"{exc}; choose another {option(exc.setting)}"
    if isinstance(exc, NotReportFolder):
        return f"{exc}; choose a new or empty folder for {option(exc.setting)}"
    if isinstance(exc, TargetUnwritable):
        return f"{exc}; choose a writable {option(exc.setting)} with free space"
    if isinstance(exc, NothingSelected):
        asked = " ".join(f"--{k} {v}" for k, v in (("step", exc.step), ("layer", exc.layer), ("head", exc.head))
                         if v is not None)
        return (f"{exc.path}: nothing matches {asked or 'the selection'}; run `fa-forensics info {exc.path}` to list "
                "what exists")
    if isinstance(exc, NoTimeline):
        return f"{str(exc).split(';')[0]}; record one with `fa-forensics capture --monitor-every N ...`"
    if isinstance(exc, InvalidSetting):
        return f"{option(exc.setting)}: {exc.reason}"
    return str(exc)


def environment_line(exc: BaseException) -> str | None:
    """One worded line for what the machine (not the user's input) refused: memory, the file system, a
    safetensors write; None for anything else (a bug, shown as such)."""
    import errno

    if isinstance(exc, MemoryError):
        return ("out of memory; the dump may claim sizes it does not hold (run `fa-forensics verify DUMP`), "
                "or select less with --step, --layer, --head")
    if isinstance(exc, OSError):
        where = f" at {exc.filename}" if exc.filename else ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            what = "the disk quota is exhausted" if exc.errno == errno.EDQUOT else "no space left on the device"
            return f"{what}{where}; free space there or write the output elsewhere"
        return f"the file system refused{where}: {exc.strerror or exc}; check the path and its permissions"
    if type(exc).__name__ == "SafetensorError":
        text = " ".join(str(exc).split())
        if "os error 28" in text or "os error 122" in text:
            return "no space left on the device writing a safetensors file; free space there or write it elsewhere"
        return f"safetensors refused the file: {text[:200]}; check the file"
    return None
