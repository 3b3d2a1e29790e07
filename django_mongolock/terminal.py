"""Text from lock documents (keys, owners, group names) made safe to print on a terminal.

Keys and owners are chosen by whoever takes a lock. Printed raw, a newline in a key would
forge a row of ``mongolock list``, an ESC sequence could clear the screen or retitle the
window, and a bidi override (U+202E) would show the rest of the line reversed.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with each character that is not printable escaped as ``repr`` escapes it.

    That is every control character (C0, DEL, C1: ``\\n``, ``\\r``, ``\\x1b``, ``\\x9b``),
    every format character (bidi controls U+202A-U+202E and U+2066-U+2069, zero-width
    characters), line and paragraph separators, and spaces other than U+0020. Everything
    else, backslashes included, is kept as it is, so plain keys read unchanged.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
