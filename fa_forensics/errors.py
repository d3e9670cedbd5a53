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

