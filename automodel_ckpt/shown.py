"""Text on the user's terminal: control characters escaped, so that no name read from a folder can drive it.

A name read from someone else's folder, printed raw, could retitle the terminal, rewrite lines or forge one. Every
verb's output passes through ``EscapingStream``, which writes C0 controls (but newline, tab and a leading carriage
return), DEL, C1 and bidirectional controls as ``\\x1b``-style escapes.
"""

from __future__ import annotations

import re
from typing import Any, TextIO

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_COLOR = re.compile(r"\x1b\[[0-9;]{0,16}m")


def escaped(text: str) -> str:
    """``text`` with every unsafe character written as an escape (``\\x1b``, ``\\u202e``)."""
    return _UNSAFE.sub(_code, text)


def one_line(text: str) -> str:
    """``text`` as one line: ``escaped``, its newlines and tabs written as ``\\n`` and ``\\t``."""
    return escaped(text.strip()).replace("\n", "\\n").replace("\t", "\\t")


def _code(match: re.Match[str]) -> str:
    o = ord(match.group())
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


class EscapingStream:
    """``stream`` writing ``escaped`` text (``colors``: SGR colour sequences pass through)."""

    def __init__(self, stream: TextIO, *, colors: bool = False) -> None:
        self.stream = stream
        self.colors = colors

    def write(self, text: str) -> int:
        start = "\r" if text.startswith("\r") else ""
        body = text[len(start):]
        if self.colors:
            parts = _COLOR.split(body)
            codes = _COLOR.findall(body) + [""]
            body = "".join(escaped(part) + code for part, code in zip(parts, codes))
        else:
            body = escaped(body)
        self.stream.write(start + body)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def allow_colors(enabled: bool) -> None:
    """Let SGR colour sequences through standard output (``preview --color``)."""
    import sys

    if isinstance(sys.stdout, EscapingStream):
        sys.stdout.colors = enabled


def shown_value(value: Any, width: int = 40) -> str:
    """A value read from a file, short and safe in a one-line message (a huge integer: by its size, never digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value)}"
    if not isinstance(value, (str, bytes, int, float, bool, type(None))):
        return f"a {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
