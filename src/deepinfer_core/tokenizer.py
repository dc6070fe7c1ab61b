"""Tokenizers behind the :class:`~deepinfer_core.protocols.Tokenizer` seam.

``ByteTokenizer`` is the built-in tokenizer of the tiny model (no download): ids 0-2 are <bos>, <eos>,
<pad> (pad id 2 is also the Engram pad, as in DeepSeek's vocab), ids 3..258 are the 256 bytes, and the
rest of the vocabulary up to ``vocab_size`` are reserved control tokens (one is the DSpark noise token).
``HFTokenizer`` wraps any HuggingFace ``tokenizers`` tokenizer.json. ``V41Tokenizer`` is the shipped
model's byte-level BPE (trained by ``scripts/train_tiny.py``) with the V4.1 control tokens and a chat
encoding that inserts every control token by id (so user text can never become one; docs/model.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
BYTE_OFFSET = 3


class ByteTokenizer:
    """UTF-8 bytes as tokens, with control tokens matched by id only (text can never produce them)."""

    __slots__ = ("_special", "_vocab_size")

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < BYTE_OFFSET + 256 + 1:
            raise ValueError(
                f"vocab_size={vocab_size}: must be >= {BYTE_OFFSET + 256 + 1} (3 specials, 256 bytes, noise)"
            )
        self._vocab_size = vocab_size
        self._special = frozenset([BOS_ID, EOS_ID, PAD_ID, *range(BYTE_OFFSET + 256, vocab_size)])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int:
        return BOS_ID

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    @property
    def noise_token_id(self) -> int:
        """The DSpark drafter's noise token (first reserved id after the bytes)."""
        return BYTE_OFFSET + 256

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        return [
            bytes([i - BYTE_OFFSET]) if BYTE_OFFSET <= i < BYTE_OFFSET + 256 else b""
            for i in range(self._vocab_size)
        ]


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer.json behind the library's protocol."""

    def __init__(self, path_or_tokenizer: str | Path | object, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _Tok  # optional dependency

        tok = (
            path_or_tokenizer
            if isinstance(path_or_tokenizer, _Tok)
            else _Tok.from_file(str(path_or_tokenizer))
        )
        # Control tokens typed as text must encode as plain text, never as the control id.
        tok.encode_special_tokens = True
        self._tok = tok
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)
        added = tok.get_added_tokens_decoder()  # id -> AddedToken
        self._special = frozenset(i for i, t in added.items() if t.special)
        eos_candidates = (
            [eos_token]
            if eos_token
            else ["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<｜end▁of▁sentence｜>"]
        )
        eos = next((tok.token_to_id(t) for t in eos_candidates if t and tok.token_to_id(t) is not None), None)
        if eos is None:
            raise ValueError(f"eos_token: none of {eos_candidates} is in the vocabulary; pass eos_token=")
        self._eos = int(eos)
        self._bytes: list[bytes] | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self) -> list[bytes]:
        if self._bytes is None:
            self._bytes = [
                b"" if i in self._special else _token_to_bytes(self._tok, i) for i in range(self._vocab_size)
            ]
        return self._bytes


def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's printable mapping of bytes used by byte-level BPE vocabularies.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_level_decoder()


def _token_to_bytes(tok: object, i: int) -> bytes:
    piece = tok.id_to_token(i)  # type: ignore[attr-defined]
    if piece is None:
        return b""
    if all(ch in _BYTE_DECODER for ch in piece):
        return bytes(_BYTE_DECODER[ch] for ch in piece)
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # sentencepiece byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode("utf-8")


# ---------------------------------------------------------------- the V4.1 control tokens
# DeepSeek's names (ids 0-2 as in its vocabulary: bos, eos, pad = the Engram pad); the DSpark noise
# token's name is ours (the release's is not public), placed at the last id like dspark_noise_token_id.
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
NOISE = "<｜dspark▁noise｜>"
CONTROL_TOKENS = (
    BOS,
    EOS,
    PAD,
    USER,
    ASSISTANT,
    THINK,
    END_THINK,
    CALLS_BEGIN,
    CALLS_END,
    CALL_BEGIN,
    CALL_END,
    TOOL_SEP,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    OUTPUT_BEGIN,
    OUTPUT_END,
)


def train_bpe(texts: Iterable[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE (``tokenizers``) with the control tokens at ids 0..15, the 256 bytes next, merges
    up to ``vocab_size - 1`` and the noise token at ``vocab_size - 1``. Every control token is special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        special_tokens=[AddedToken(t, special=True) for t in CONTROL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(NOISE, special=True)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size or tok.token_to_id(NOISE) != vocab_size - 1:
        raise ValueError(
            f"vocab_size={vocab_size}: the corpus gave {tok.get_vocab_size(with_added_tokens=True)} "
            "tokens; it needs enough text for every merge"
        )
    return tok


class ChatError(ValueError):
    """A chat message is malformed: the message names the field."""


class V41Tokenizer(HFTokenizer):
    """The shipped model's tokenizer: BPE text plus the V4.1 control tokens, matched by id only.

    :meth:`encode_chat` renders messages the way DeepSeek's API does (role markers and tool-call markers
    inserted by id, text pieces encoded with control-token matching off), :meth:`parse_assistant` reads
    generated ids back, recognising tool calls by their marker ids, never by text.
    """

    def __init__(self, path_or_tokenizer: str | Path | object) -> None:
        super().__init__(path_or_tokenizer, eos_token=EOS)
        ids = {}
        for t in (*CONTROL_TOKENS, NOISE):
            i = self._tok.token_to_id(t)
            if i is None or i not in self._special:
                raise ValueError(f"tokenizer: control token {t!r} is missing or not special")
            ids[t] = int(i)
        self.control_ids: dict[str, int] = ids

    @property
    def bos_token_id(self) -> int:
        return self.control_ids[BOS]

    @property
    def pad_token_id(self) -> int:
        return self.control_ids[PAD]

    @property
    def noise_token_id(self) -> int:
        return self.control_ids[NOISE]

    def _c(self, name: str) -> list[int]:
        return [self.control_ids[name]]

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        thinking: bool = False,
    ) -> list[int]:
        """Token ids of a conversation (``role`` in system / user / assistant / tool; an assistant message
        may carry ``tool_calls`` [{"name", "arguments"}]). Text is always encoded as text.

        Every malformed input is a :class:`ChatError` naming its field and index (``messages[3].content``,
        ``messages[1].tool_calls[0].arguments``, ``tools[2]``), found before anything is encoded."""
        msgs = _check_chat(messages, tools)
        ids = self._c(BOS)
        sys_text = "\n\n".join(m.content for m in msgs if m.role == "system")
        if tools:
            sys_text += (
                ("\n\n" if sys_text else "")
                + "## Tools\n"
                + "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)
            )
        ids += self.encode(sys_text)
        in_outputs = False
        for m in msgs:
            if m.role == "system":
                continue
            if m.role != "tool" and in_outputs:
                ids += self._c(OUTPUTS_END)
                in_outputs = False
            if m.role == "user":
                ids += self._c(USER) + self.encode(m.content)
            elif m.role == "assistant":
                ids += self._c(ASSISTANT) + self._c(END_THINK) + self.encode(m.content)
                if m.calls:
                    ids += self._c(CALLS_BEGIN)
                    for name, args in m.calls:
                        ids += (
                            self._c(CALL_BEGIN)
                            + self.encode(name)
                            + self._c(TOOL_SEP)
                            + self.encode(args)
                            + self._c(CALL_END)
                        )
                    ids += self._c(CALLS_END)
                ids += self._c(EOS)
            else:  # tool
                if not in_outputs:
                    ids += self._c(OUTPUTS_BEGIN)
                    in_outputs = True
                ids += self._c(OUTPUT_BEGIN) + self.encode(m.content) + self._c(OUTPUT_END)
        if in_outputs:
            ids += self._c(OUTPUTS_END)
        if add_generation_prompt:
            ids += self._c(ASSISTANT) + self._c(THINK if thinking else END_THINK)
        return ids

    def parse_assistant(self, ids: Sequence[int]) -> dict[str, Any]:
        """{"reasoning", "content", "tool_calls": [{"name", "arguments"}]} of generated ids. Structure is
        read from control-token ids only: marker-looking text stays content."""
        c = self.control_ids
        ids = list(ids)
        if c[EOS] in ids:
            ids = ids[: ids.index(c[EOS])]
        reasoning: list[int] = []
        if c[END_THINK] in ids:
            k = ids.index(c[END_THINK])
            reasoning, ids = [i for i in ids[:k] if i != c[THINK]], ids[k + 1 :]
        calls: list[dict[str, str]] = []
        if c[CALLS_BEGIN] in ids:
            k = ids.index(c[CALLS_BEGIN])
            ids, rest = ids[:k], ids[k + 1 :]
            while c[CALL_BEGIN] in rest:
                rest = rest[rest.index(c[CALL_BEGIN]) + 1 :]
                end = rest.index(c[CALL_END]) if c[CALL_END] in rest else len(rest)
                body, rest = rest[:end], rest[end + 1 :]
                sep = body.index(c[TOOL_SEP]) if c[TOOL_SEP] in body else len(body)
                calls.append({"name": self.decode(body[:sep]), "arguments": self.decode(body[sep + 1 :])})
        return {"reasoning": self.decode(reasoning), "content": self.decode(ids), "tool_calls": calls}


ROLES = ("system", "user", "assistant", "tool")


class _Msg:
    __slots__ = ("calls", "content", "role")

    def __init__(self, role: str, content: str, calls: list[tuple[str, str]]) -> None:
        self.role, self.content, self.calls = role, content, calls


def _kind(v: object) -> str:
    return type(v).__name__


def _text(v: object, where: str, *, allow_none: bool = False) -> str:
    """``v`` as text that UTF-8 can encode, or a ChatError naming ``where``."""
    if v is None and allow_none:
        return ""
    if not isinstance(v, str):
        raise ChatError(f"{where}: must be a string{' or None' if allow_none else ''} (got {_kind(v)})")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChatError(f"{where}: not valid Unicode text (a lone surrogate at index {e.start})") from None
    return v


def _json(v: object, where: str) -> str:
    """A tool call's arguments or a tool schema as JSON text, or a ChatError naming ``where``."""
    try:
        return json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:  # a set, bytes, NaN, a cycle, nesting too deep
        raise ChatError(
            f"{where}: must be a JSON string or a JSON-serialisable value ({type(e).__name__}: "
            f"{str(e)[:200]})"
        ) from None


def _check_chat(messages: object, tools: object) -> list[_Msg]:
    """Validate a conversation before anything is encoded; the messages as (role, text, tool calls)."""
    if isinstance(messages, str | bytes | bytearray | Mapping) or not isinstance(messages, Sequence):
        raise ChatError(f"messages: must be a list of message dicts (got {_kind(messages)})")
    if tools is not None:
        if isinstance(tools, str | bytes | bytearray | Mapping) or not isinstance(tools, Sequence):
            raise ChatError(f"tools: must be a list of tool dicts (got {_kind(tools)})")
        for k, t in enumerate(tools):
            if not isinstance(t, Mapping):
                raise ChatError(f"tools[{k}]: must be a dict (got {_kind(t)})")
            _text(_json(t, f"tools[{k}]"), f"tools[{k}]")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatError(f"messages[{i}]: must be a dict with 'role' and 'content' (got {_kind(m)})")
        if "role" not in m:
            raise ChatError(f"messages[{i}].role: missing; must be one of {', '.join(map(repr, ROLES))}")
        role = m["role"]
        if role not in ROLES:
            small = (
                role is None
                or isinstance(role, bool | float)
                or (isinstance(role, str) and len(role) <= 40)
                or (isinstance(role, int) and abs(role) < 10**30)
            )
            shown = repr(role) if small else f"<{_kind(role)}>"  # never a huge value's repr in the message
            raise ChatError(f"messages[{i}].role={shown}: must be one of {', '.join(map(repr, ROLES))}")
        content = _text(m.get("content"), f"messages[{i}].content", allow_none=role == "assistant")
        calls: list[tuple[str, str]] = []
        raw = m.get("tool_calls")
        if raw and role != "assistant":
            raise ChatError(
                f"messages[{i}].tool_calls: only an assistant message may carry tool calls (role {role!r})"
            )
        if raw:
            if isinstance(raw, str | bytes | bytearray | Mapping) or not isinstance(raw, Sequence):
                raise ChatError(
                    f"messages[{i}].tool_calls: must be a list of {{'name', 'arguments'}} dicts (got {_kind(raw)})"
                )
            for j, c in enumerate(raw):
                where = f"messages[{i}].tool_calls[{j}]"
                if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
                    raise ChatError(f"{where}: needs a 'name' string")
                name = _text(c["name"], f"{where}.name")
                args = c.get("arguments", "")
                args = args if isinstance(args, str) else _json(args, f"{where}.arguments")
                calls.append((name, _text(args, f"{where}.arguments")))
        out.append(_Msg(role, content, calls))
    return out
