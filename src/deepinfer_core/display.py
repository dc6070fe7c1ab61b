"""Printing model text safely: a byte-level model can emit any byte, and raw control bytes (NUL, BEL, ESC
sequences) written to a terminal beep, move the cursor or garble the screen."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["is_safe", "printable", "printable_bytes", "printable_completion"]

# Kept as they are: they lay text out and cannot drive the terminal.
_KEEP = {"\n", "\t"}
# Escaped although printable: U+FFFD stands for bytes that did not decode; printed, it hides which.
_ESCAPE = {"\ufffd"}


def _shown(ch: str) -> bool:
    return ch in _KEEP or (ch.isprintable() and ch not in _ESCAPE)


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\u200b``, ...), newlines and tabs
    kept; printable text (any script) is returned unchanged. U+FFFD (what a decoder puts for bytes that are
    not UTF-8) is escaped as ``\\ufffd``; :func:`printable_completion` shows the bytes themselves."""
    if text.isprintable() and "\ufffd" not in text:
        return text
    out = []
    for ch in text:
        if _shown(ch):
            out.append(ch)
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


def printable_bytes(data: bytes) -> str:
    """UTF-8 ``data`` for a terminal: what decodes is shown (unsafe characters escaped as in
    :func:`printable`), each byte that does not as ``\\xNN``."""
    return printable(data.decode("utf-8", errors="backslashreplace"))


def printable_completion(text: str, token_ids: Sequence[int], token_bytes: Sequence[bytes] | None) -> str:
    """A model's output for a terminal. A byte-level model can stop inside a UTF-8 sequence or emit bytes
    that are not UTF-8 at all, which the tokenizer decodes as U+FFFD: when the tokens' bytes
    (``token_bytes[id]``, the tokenizer's table) decode to exactly ``text``, those bytes are shown as
    ``\\xNN`` escapes; otherwise (e.g. a stop string cut the text) :func:`printable` escapes U+FFFD."""
    if "\ufffd" in text and token_bytes is not None:
        n = len(token_bytes)
        data = b"".join(token_bytes[t] for t in token_ids if 0 <= t < n)
        if data.decode("utf-8", errors="replace") == text:
            return printable_bytes(data)
    return printable(text)


def is_safe(text: str) -> bool:
    """True if ``text`` holds no character that :func:`printable` would escape."""
    return all(_shown(ch) for ch in text)
