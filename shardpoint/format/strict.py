"""Strict, bounded parsing of the checkpoint's JSON metadata, and the limits that bound it.

A checkpoint is untrusted input. Python's ``json`` accepts documents that the
format never writes and that break code further on: ``NaN`` and
``Infinity``, duplicate keys (the last one silently wins), integers of any
length (a 400-digit ``created`` overflows ``float``; past 4,300 digits
``json`` itself raises a plain ``ValueError``), unbounded nesting, and lone
UTF-16 surrogates (``"\\ud800"``) that cannot be encoded back to UTF-8.
:func:`strict_loads` rejects all of them with a :class:`FormatError` that
names the checkpoint and, where it can, the field.

:class:`Limits` holds the bounds. The defaults come from the format
(docs/format.md, "Limits"); each can be raised through an environment
variable for an unusual checkpoint, without code changes.

Example::

    doc = strict_loads(data, "ckpt/step_100: manifest.json")
    lim = Limits.from_env(); lim.manifest_bytes   # 268435456 unless overridden
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from ..errors import FormatError

__all__ = ["Limits", "strict_loads", "INT64_MIN", "INT64_MAX"]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# Digits (and sign) of the longest int64 literal: "-9223372036854775808" is 20 characters.
_MAX_INT_CHARS = 20


@dataclass(frozen=True)
class Limits:
    """Upper bounds on the checkpoint metadata a reader accepts, checked before reading or parsing.

    - ``manifest_bytes``: size of ``manifest.json`` (default 256 MiB;
      ``SHARDPOINT_MAX_MANIFEST_BYTES``).
    - ``index_bytes``: size of one rank's index file (default 1 GiB, about
      8 million chunk records; ``SHARDPOINT_MAX_INDEX_BYTES``).
    - ``string_chars``: length of one JSON string, keys included (default
      16 Mi characters; ``SHARDPOINT_MAX_STRING_CHARS``).
    - ``depth``: nesting of JSON arrays and objects (default 256;
      ``SHARDPOINT_MAX_JSON_DEPTH``). The value codec nests at most 64
      values deep, and a tagged value takes two JSON levels.

    Example::

        os.environ["SHARDPOINT_MAX_MANIFEST_BYTES"] = str(1 << 30)
        Limits.from_env().manifest_bytes   # 1073741824
    """

    manifest_bytes: int = 256 << 20
    index_bytes: int = 1 << 30
    string_chars: int = 16 << 20
    depth: int = 256

    @staticmethod
    def from_env() -> "Limits":
        """The defaults, with any ``SHARDPOINT_MAX_*`` environment overrides applied."""
        env = {
            "manifest_bytes": "SHARDPOINT_MAX_MANIFEST_BYTES",
            "index_bytes": "SHARDPOINT_MAX_INDEX_BYTES",
            "string_chars": "SHARDPOINT_MAX_STRING_CHARS",
            "depth": "SHARDPOINT_MAX_JSON_DEPTH",
        }
        kw = {}
        for f in fields(Limits):
            raw = os.environ.get(env[f.name])
            if raw is None:
                continue
            try:
                v = int(raw)
            except ValueError:
                v = 0
            if v < 1:
                raise ValueError(f"{env[f.name]} must be a positive integer, got {raw!r}")
            kw[f.name] = v
        return Limits(**kw)


def _reject_constant(name: str) -> Any:
    raise FormatError(f"non-finite number {name}")


def _parse_int(text: str) -> int:
    if len(text) > _MAX_INT_CHARS:
        raise FormatError(f"integer of {len(text)} digits is outside int64")
    v = int(text)
    if not INT64_MIN <= v <= INT64_MAX:
        raise FormatError(f"integer {text} is outside int64")
    return v


def _parse_float(text: str) -> float:
    if len(text) > 400:
        raise FormatError(f"number literal of {len(text)} characters")
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise FormatError(f"number {text[:40]} is outside the float64 range")
    return v


def _pairs(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise FormatError(f"duplicate key {k[:80]!r}")
            seen.add(k)
    return out


def _check_str(s: str, limits: Limits) -> None:
    if len(s) > limits.string_chars:
        raise FormatError(f"string of {len(s)} characters exceeds the limit of {limits.string_chars}")
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError(f"string {s[:40]!r} holds a lone surrogate, which is not valid Unicode text") from None


def _check_depth(doc: Any, limit: int) -> None:
    """Nesting of arrays and objects at most ``limit``: one pass per level over containers only."""
    level, depth = [doc], 1
    while level:
        if depth > limit:
            raise FormatError(f"nesting deeper than {limit} levels")
        nxt: list = []
        add = nxt.extend
        for v in level:
            add([x for x in (v.values() if type(v) is dict else v) if type(x) is dict or type(x) is list])
        level, depth = nxt, depth + 1


def _walk_strings(doc: Any, limits: Limits) -> None:
    """Check every string, keys included (only when a cheap scan of the text says it may be needed)."""
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            _check_str(v, limits)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_str(k, limits)
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)


# A \uD800-\uDFFF escape: the only way JSON text can carry a surrogate (UTF-8 input cannot).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def strict_loads(data: bytes | str, where: str, limits: Limits | None = None, what: str = "metadata") -> Any:
    """Parse untrusted JSON text strictly; raise ``FormatError(f"{where}: ...")`` on anything off.

    Accepts only what the format writes: UTF-8 text, finite numbers,
    integers within int64, unique object keys, nesting and strings within
    ``limits`` (:meth:`Limits.from_env` by default), valid Unicode strings.

    Example::

        strict_loads(b'{"a": 1}', "ckpt")            # {'a': 1}
        strict_loads(b'{"a": NaN}', "ckpt")          # FormatError: ckpt: metadata ... non-finite number NaN
    """
    limits = limits or Limits.from_env()
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        doc = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_int=_parse_int,
            parse_float=_parse_float,
            object_pairs_hook=_pairs,
        )
        if isinstance(doc, (dict, list)):
            _check_depth(doc, limits.depth)
        if len(text) > limits.string_chars or _SURROGATE_ESCAPE.search(text):
            _walk_strings(doc, limits)
    except FormatError as e:
        raise FormatError(f"{where}: {what} is not valid JSON for this format: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError, MemoryError) as e:
        raise FormatError(f"{where}: {what} is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    return doc
