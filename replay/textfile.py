"""Reading an input file's text: one rule for every CSV and TOML input.

- UTF-8, with or without a byte-order mark (spreadsheets write one; it is dropped);
- UTF-16 or UTF-32 **with** a byte-order mark (Excel's "Unicode text") is decoded;
- anything else that is not valid UTF-8 (Latin-1, Windows-1252, ...) is refused
  with one :class:`InputFileError` naming the file, the line, the column and the
  byte, never a traceback and never a silent guess at the encoding (a wrong guess
  would turn names into other names).
"""

from __future__ import annotations

import codecs
from pathlib import Path

from .errors import InputFileError

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),  # before UTF-16 LE: it starts with the same two bytes
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def read_text(path: str | Path) -> str:
    """The text of ``path``; raises :class:`InputFileError` when it cannot be read or decoded."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputFileError(str(path), None, f"cannot read: {exc.strerror or exc}") from None
    return decode_text(data, str(path))


def decode_text(data: bytes, name: str) -> str:
    """``data`` decoded by the rules above; ``name`` is the file named in an error."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding)  # the codec drops the mark
            except UnicodeDecodeError:
                raise InputFileError(
                    name,
                    None,
                    f"starts with a {encoding.upper()} byte-order mark but does not decode; "
                    "save it as UTF-8",
                ) from None
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        pos = skip + exc.start
        line = data.count(b"\n", 0, pos) + 1
        column = pos - (data.rfind(b"\n", 0, pos) + 1) + 1
        raise InputFileError(
            name,
            line,
            f"not UTF-8 text: byte 0x{data[pos]:02x} at byte {column} of the line "
            f"(byte {pos} of the file); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None
