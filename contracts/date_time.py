"""The contracts' ``date-time``: timezone-aware RFC 3339, as the schemas judge it.

Its own module so the case Structs check it without building the input
Structs (:mod:`contracts.structs`) at import.
"""

from __future__ import annotations

from rfc3339_validator import RFC3339_REGEX, validate_rfc3339

__all__ = ["is_date_time"]


def is_date_time(value: str) -> bool:
    """True for a timezone-aware RFC 3339 date-time, exactly as the schemas judge it.

    The schemas' verdict is ``validate_rfc3339(value.upper())`` (what the
    jsonschema format checker calls) plus "no newline". This is the same
    test with its common case made cheap: the validator's own regex, and the
    calendar consulted only for days 29-31 or year 0000.
    """
    if "\n" in value:
        return False
    upper = value.upper()
    match = RFC3339_REGEX.match(upper)
    if match is None:
        return False
    year, _, day = match.groups()
    if "01" <= day <= "28" and year != "0000":
        return True
    return validate_rfc3339(upper)
