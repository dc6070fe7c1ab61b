"""Printing model text safely: a byte-level model can emit any byte, and raw control bytes (NUL, BEL, ESC
sequences) written to a terminal beep, move the cursor or garble the screen."""

from __future__ import annotations

__all__ = ["is_safe", "printable"]

# Kept as they are: they lay text out and cannot drive the terminal.
_KEEP = {"\n", "\t"}


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\u200b``, ...), newlines and tabs
    kept; printable text (any script) is returned unchanged. Undecodable bytes, which the tokenizer turns
    into U+FFFD, stay U+FFFD."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in _KEEP or ch.isprintable():
            out.append(ch)
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


def is_safe(text: str) -> bool:
    """True if ``text`` holds no character that :func:`printable` would escape."""
    return all(ch in _KEEP or ch.isprintable() for ch in text)
