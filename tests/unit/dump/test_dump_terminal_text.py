"""Text from a dump reaches the terminal escaped: no control character, no markup, no hyperlink."""
from __future__ import annotations

import io

from fa_forensics.commands.common import SafeConsole
from fa_forensics.dump.terminal_text import escape_controls, shown

HOSTILE = "evil\x1b]0;pwned\x07name\n[bold]x[/bold]\x1b[2J\u202egnp.exe\u2028end"


def test_shown_escapes_controls_and_markup():
    text = shown(HOSTILE)
    assert text == "evil\\x1b]0;pwned\\x07name\\n\\[bold]x\\[/bold]\\x1b[2J\\u202egnp.exe\\u2028end"
    assert shown("модель 模型 ok") == "модель 模型 ok"  # printable text of any script is unchanged
    assert escape_controls("a\nb", keep="\n") == "a\nb"


def test_the_console_escapes_what_reaches_it_raw_and_draws_no_link():
    out = io.StringIO()
    console = SafeConsole(file=out, force_terminal=True, width=200)
    console.print("[link=https://example.com]click[/link] " + HOSTILE.replace("[", "("), highlight=False)
    written = out.getvalue()
    assert "\x1b]" not in written and "\x07" not in written and "\u202e" not in written  # no OSC, no bidi
    assert "\\x1b]0;pwned" in written and "click" in written
    shown_line = SafeConsole(file=io.StringIO(), width=200)
    shown_line.print(shown(HOSTILE), highlight=False)
    assert shown_line.file.getvalue().count("\n") == 1  # one line: the newline inside is escaped
