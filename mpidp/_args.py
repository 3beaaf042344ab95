"""Checks of arguments at mpidp's public boundary, one rule for each kind of value.

Every message names the argument, the rule and the value, in one form:
``"<name> must be <rule>, got <value!r>"``. ``bool`` is never taken for an
int or a number, although Python makes it one. Imports nothing from mpidp.
"""

from __future__ import annotations

from numbers import Real

__all__ = ["check_bool", "check_int", "check_number", "check_rank", "is_int"]


def is_int(value) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_bool(name: str, value, *, optional: bool = False) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool (or None where ``optional``)."""
    if not isinstance(value, bool) and not (optional and value is None):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")


def check_int(name: str, value, *, minimum: int | None = None) -> None:
    """Raise unless ``value`` is an int (not a bool) >= ``minimum``.

    Raises:
        TypeError: with no ``minimum``, for a value that is not an int.
        ValueError: with a ``minimum``, for a value that is not an int >= it.
    """
    if minimum is None:
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
    elif not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_number(name: str, value, *, minimum: float = 0, strict: bool = True,
                 optional: bool = False, also: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is a real number > ``minimum`` (>= unless ``strict``).

    Args:
        optional: None passes too.
        also: words naming the other accepted values, for the message (", None or 'auto'").
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, Real) or not (
            value > minimum if strict else value >= minimum):
        raise ValueError(f"{name} must be a number {'>' if strict else '>='} {minimum}{also}, "
                         f"got {value!r}")


def check_rank(name: str, value, size: int) -> None:
    """Raise ``ValueError`` unless ``value`` is a rank of a group of ``size``."""
    if not is_int(value) or not 0 <= value < size:
        raise ValueError(f"invalid {name} {value!r}, {name} should be in the interval "
                         f"[0, {size - 1}]")
