"""The contracts' ``date-time``: timezone-aware RFC 3339, as the schemas judge it.

Its own module so the case Structs check it without building the input
Structs (:mod:`contracts.structs`), and the schemas' format checker
(:mod:`contracts.schemas`) calls this very function, so the two never
disagree.

RFC 3339 section 5.6: ``full-date "T" full-time``, with ``T`` and ``Z`` in
either case, a fraction of any length, and an offset of ``Z`` or ``+hh:mm``.
The calendar is checked (no 31 April, 29 February only in leap years, no
year 0000). A leap second (``:60``) is valid where RFC 3339 section 5.7 puts
one: at 23:59 UTC, so ``15:59:60-08:00`` is one and ``23:58:60Z`` is not (as
the JSON Schema test suite holds); which days had one is not checked, since
they are announced only months ahead. A newline is refused anywhere (a
``$`` in a regular expression would let one end the value).
"""

from __future__ import annotations

import calendar
import re

__all__ = ["is_date_time"]

_DATE_TIME = re.compile(
    r"(\d{4})-(0[1-9]|1[0-2])-(\d{2})"
    r"T([01]\d|2[0-3]):([0-5]\d):([0-5]\d|60)(?:\.\d+)?"
    r"(?:Z|([+-])([01]\d|2[0-3]):([0-5]\d))",
    re.ASCII,
)
_LAST_MINUTE_OF_THE_DAY = 23 * 60 + 59


def is_date_time(value: str) -> bool:
    """True for a timezone-aware RFC 3339 date-time (see the module doc).

    The common case is cheap: one match, and the calendar consulted only for
    days 29-31 or year 0000.
    """
    if not value.isascii():
        return False
    match = _DATE_TIME.fullmatch(value.upper())
    if match is None:
        return False
    year, month, day, hour, minute, second, sign, offset_hours, offset_minutes = match.groups()
    if not ("01" <= day <= "28" and year != "0000"):
        if year == "0000" or not 1 <= int(day) <= calendar.monthrange(int(year), int(month))[1]:
            return False
    if second == "60":
        offset = 0 if sign is None else (int(offset_hours) * 60 + int(offset_minutes)) * (1 if sign == "+" else -1)
        return (int(hour) * 60 + int(minute) - offset) % 1440 == _LAST_MINUTE_OF_THE_DAY
    return True
