"""Text from a dump, made safe for a terminal line: the one helper every printed line goes through.

A dump is data from elsewhere: its model name, module names, capture source, a lock file's holder, even the
names of folders beside it, may hold control characters (an ESC sequence that sets the window title, clears
the screen or draws a disguised hyperlink; a newline that breaks a table row or fakes a second message; a
bidi override that reorders what is read) and rich markup (`[bold]`, `[link=...]`).

- `escape_controls(text)`: every character that is not printable written as an escape (`\\x1b`, `\\n`,
  `\\u202e`); printable text, any script, is unchanged.
- `shown(value)`: `escape_controls` and rich's markup escape: what to put in any string rich prints.

The CLI's consoles apply `escape_controls` to every segment they write (commands/common.py), so text that
reaches a table or a line without `shown` still cannot reach the terminal raw.
"""
from __future__ import annotations

from typing import Any

from rich.markup import escape as escape_markup

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_controls(text: str, keep: str = "") -> str:
    """`text` with every non-printable character (control, format, separator other than the space) written as an
    escape; characters in `keep` (e.g. the newlines a console itself writes) are left as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escaped(c) for c in text)


def shown(value: Any) -> str:
    """`str(value)` ready for a rich string: control characters escaped, markup escaped."""
    return escape_markup(escape_controls(str(value)))
