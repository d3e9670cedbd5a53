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
