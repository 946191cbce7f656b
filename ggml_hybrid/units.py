"""Byte sizes as text and back: the one formatter and the one parser every report and flag uses."""

from __future__ import annotations

from .errors import OptionError

KiB, MiB, GiB, TiB = 2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40
_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_bytes(n: int | float) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals: '3.25 MiB', '812 B'."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str) -> int:
    """'24G', '24GiB', '1.5T', '800M', '123456' (bytes) -> bytes (binary units)."""
    if not isinstance(text, str):
        raise OptionError(f"size {text!r}: expected text such as 24G")
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" and t else t
    try:
        v = float(num)
    except ValueError:
        raise OptionError(f"size {text!r}: expected a number with an optional K/M/G/T suffix, e.g. 24G") from None
    if not v >= 0 or v == float("inf"):
        raise OptionError(f"size {text!r}: must be a finite size >= 0")
    return int(v * mult)


__all__ = ["GiB", "KiB", "MiB", "TiB", "format_bytes", "parse_size"]
