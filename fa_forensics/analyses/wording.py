"""Numbers in sentences: a value that was not measured reads "n/a", never "nan%" or "n/a%"."""
from __future__ import annotations

import math


def finite(x) -> bool:
    """True for a real finite number (bools and None are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def percent(fraction, digits: int = 0, *, signed: bool = False, missing: str = "n/a") -> str:
    """A fraction as a percentage ("37%", "+1.5%"), or `missing` (no % sign) when it is not a finite number."""
    if not finite(fraction):
        return missing
    return format(fraction, f"{'+' if signed else ''}.{digits}%")


def share_with_se(share, se, digits: int = 0, *, signed: bool = False, missing: str = "n/a") -> str:
    """"37% ± 5%"; "37%" when se is not finite; `missing` when the share is not."""
    if not finite(share):
        return missing
    text = percent(share, digits, signed=signed)
    return f"{text} ± {percent(se, digits)}" if finite(se) else text


def number(x, fmt: str = "+.3e", missing: str = "n/a") -> str:
    """format(x, fmt) for a finite number, else `missing`."""
    return format(x, fmt) if finite(x) else missing



def bit_share(fraction, digits: int = 1, *, floor: bool = False, max_digits: int = 6) -> str:
    """A share of bit-identical elements as "99.97 %": `digits` decimals, more (up to `max_digits`) where they would
    round a share below 1 up to "100.0 %" (never claims every bit when some differ); floor: the digits are cut, not
    rounded (a lower bound never overstates); "n/a" when not measured."""
    if not finite(fraction):
        return "n/a"
    while fraction < 1.0 and round(100 * fraction, digits) >= 100.0 and digits < max_digits:
        digits += 1
    if floor:
        return f"{math.floor(100 * fraction * 10 ** digits) / 10 ** digits:.{digits}f} %"
    return f"{100 * fraction:.{digits}f} %"


def pm(value, se, fmt: str = "+.3g", se_fmt: str = ".2g", missing: str = "n/a") -> str:
    """'+2.45 ± 0.24'; the value alone when se is not finite; `missing` when the value is not."""
    if not finite(value):
        return missing
    return f"{format(value, fmt)} ± {format(se, se_fmt)}" if finite(se) else format(value, fmt)


def p_value(p, missing: str = "n/a") -> str:
    """A p-value for a sentence or a table: '< 1e-300' for 0, 2 significant digits, `missing` when not a number."""
    if not finite(p):
        return missing
    return "< 1e-300" if p == 0 else f"{p:.2g}"


def yes_no(flag, missing: str = "n/a") -> str:
    """'yes' / 'no' for a bool, `missing` otherwise (never 'None')."""
    return ("yes" if flag else "no") if isinstance(flag, bool) else missing


def text(x, missing: str = "n/a") -> str:
    """str(x) for a value that is there, `missing` for None or a non-finite number (never 'None' or 'nan')."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return missing
    return str(x)


def place(d: dict, *keys: str) -> str:
    """'step 0 layer 0 head 1' from the named keys of a payload dict (missing ones read n/a)."""
    return " ".join(f"{k} {text(d.get(k))}" for k in keys)
