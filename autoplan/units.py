"""Numbers as autoplan prints them: SI prefixes, three significant digits, no exponent.

The report, the CLI summary, `str(Plan)`, the planner's reasons and the runtime's step metrics
all format through this module (no torch, no autoplan imports), so one number reads the same
everywhere.
"""

from __future__ import annotations

import math

__all__ = ["fmt_si", "fmt_bytes", "fmt_time", "fmt_count", "fmt_flops", "fmt_pct", "plural"]


# [Note: number format]
# Every number the report and the CLI summary print goes through these functions: three
# significant digits with an SI prefix (1 kB = 1e3 B, 1 ms = 1e-3 s), never an exponent, and a
# value below half the smallest step a function shows prints as an exact 0, so that a float
# residue (a bubble of 1.78e-15 s, the difference of two equal sums) reads "0 s".

_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"),
             (1.0, ""), (1e-3, "m"), (1e-6, "\u00b5"), (1e-9, "n"))  # \u00b5: the micro sign


def _digits(x: float) -> str:
    """Three significant digits without an exponent: 0.125, 12.3, 456, 7890."""
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def fmt_si(value: float, unit: str, *, smallest: float = 1e-9, largest: float = 1e18) -> str:
    """`value` (in `unit`) with three significant digits and the largest SI prefix between
    `smallest` and `largest` (as factors: 1e-3 is "m") that keeps it at 1 or more:
    fmt_si(4.2e-5, "s") == "42 \u00b5s". |value| < smallest / 2 prints as "0 unit" ([Note:
    number format]); beyond `largest` the digits grow ("2400 s"); inf and nan print as Python
    writes them."""
    if not math.isfinite(value):
        return f"{value} {unit}"
    if abs(value) < smallest / 2:
        return f"0 {unit}".rstrip()
    rounded = float(f"{value:.3g}")  # round first: 999.7 k -> 1 M, not "1e+03 k"
    prefixes = [(size, p) for size, p in _PREFIXES if smallest <= size <= largest]
    size, prefix = next(((s, p) for s, p in prefixes if abs(rounded) >= s), prefixes[-1])
    return f"{_digits(rounded / size)} {prefix}{unit}".rstrip()


def fmt_bytes(nbytes: float) -> str:
    """12.3 GB, 456 MB, 372 kB, 12 B, 0 B (SI: 1 GB = 1e9 B; [Note: number format])."""
    return fmt_si(nbytes, "B", smallest=1.0)


def fmt_time(seconds: float) -> str:
    """1.23 s, 45.6 ms, 7.8 \u00b5s, 0 s, to the nanosecond; "2400 s" above a thousand
    seconds ([Note: number format])."""
    return fmt_si(seconds, "s", largest=1.0)


def fmt_count(n: float) -> str:
    """70.6 G, 124 M, 28.5 k, 12, 0.125, 0 (decimal SI prefixes, [Note: number format])."""
    if abs(n) < 1:
        return "0" if abs(n) < 5e-4 else f"{n:.3g}"
    return fmt_si(n, "", smallest=1.0)


def fmt_flops(flops: float, *, per_s: bool = False) -> str:
    """942 PFLOP, or with `per_s` 475 TFLOP/s ([Note: number format])."""
    return fmt_si(flops, "FLOP/s" if per_s else "FLOP", smallest=1.0)


def fmt_pct(fraction: float, *, sign: bool = False) -> str:
    """`fraction` as a percentage: one decimal from 1 % (48.0 %), three significant digits
    below (0.0105 %), "< 0.001 %" below that, and "0 %" when |fraction| < 1e-9 (a float
    residue, [Note: number format]). `sign` writes a change: "+7.0 %", "-3.2 %"."""
    if not math.isfinite(fraction):
        return f"{fraction} %"
    if abs(fraction) < 1e-9:
        return "0 %"
    pct = 100 * fraction
    plus = "+" if sign and pct > 0 else ""
    if abs(pct) < 0.001:
        return "< 0.001 %" if pct > 0 else "> -0.001 %"
    if abs(float(f"{pct:.3g}")) < 1:  # 0.99996 % rounds up to the one-decimal form
        return f"{plus}{pct:.3g} %"
    return f"{plus}{pct:.1f} %"


def plural(count: int, noun: str) -> str:
    """"1 microbatch", "4 microbatches", "8 nodes": the count and the noun in its number."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun}{'es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's'}"
