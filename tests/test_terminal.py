"""``printable``: what a terminal would act on is escaped; everything else is left alone."""

from __future__ import annotations

import pytest

from django_mongolock.terminal import printable


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b[2J", r"\x1b[2J"),
        ("a\nb", r"a\nb"),
        ("a\r\nb", r"a\r\nb"),
        ("tab\there", r"tab\there"),
        ("del\x7f", r"del\x7f"),
        ("c1\x9b31m\x85", r"c1\x9b31m\x85"),
        ("\u202eabc\u202c", r"\u202eabc\u202c"),
        ("\u202a\u202b\u202d", r"\u202a\u202b\u202d"),
        ("\u2066\u2067\u2068x\u2069", r"\u2066\u2067\u2068x\u2069"),
        ("zero\u200bwidth", r"zero\u200bwidth"),
        ("line\u2028sep", r"line\u2028sep"),
        ("no\xa0break", r"no\xa0break"),
    ],
)
def test_controls_are_escaped(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(text).isprintable()


@pytest.mark.parametrize(
    "text", ["report-gen", "invoice 7", "crème-brûlée", "日本語キー", "back\\slash", "", "emoji 🔒"]
)
def test_printable_text_is_unchanged(text: str) -> None:
    assert printable(text) == text
