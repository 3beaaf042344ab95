"""Reading ``MPIDP_*`` environment variables, one rule for all of them.

Imports nothing from mpidp and never touches MPI, so any module may use it.
"""

from __future__ import annotations

import os

__all__ = ["choice", "flag", "given", "number", "text"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """Read a boolean variable: 1/true/yes/on or 0/false/no/off, any case; unset or empty is ``default``.

    Raises:
        ValueError: naming the variable, the accepted spellings and the value.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)} "
                     f"(any case), got {value!r}")


def number(name: str, default: float, *, minimum: float = 0, integer: bool = False) -> float:
    """Read a number >= ``minimum`` (an int if ``integer``); unset or empty is ``default``.

    Raises:
        ValueError: naming the variable, the rule and the value.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    kind = "an integer" if integer else "a number"
    try:
        parsed = int(value) if integer else float(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed != parsed or parsed < minimum:
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")
    return parsed


def given(name: str) -> bool:
    """True if the variable is set to something other than blanks (what the readers take for unset)."""
    return bool(os.environ.get(name, "").strip())


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Read one of ``choices`` (lowercase), any case; unset or empty is ``default``.

    Raises:
        ValueError: naming the variable, the choices and the value.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (any case), got {value!r}")
    return value.lower()


def text(name: str) -> str | None:
    """Read a free-form value (an address, an interface name), stripped; unset or blank is None."""
    value = os.environ.get(name, "").strip()
    return value or None
