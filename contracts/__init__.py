"""The project's contracts: bundled Draft 2020-12 schemas and the msgspec Structs
that mirror them.

The schema side (``REGISTRY``, ``validator``, ``validate``, ...) lives in
:mod:`contracts.schemas` and is loaded on first use: importing jsonschema and
building the registry costs about a tenth of a second, which a no-op rebuild
(whose fast path only needs the Structs) should not pay.
"""

from __future__ import annotations

__all__ = [
    "FORMAT_CHECKER",
    "REGISTRY",
    "SCHEMA_IDS",
    "SCHEMAS",
    "FORMATS",
    "Validator",
    "schema_id",
    "validator",
    "validate",
]


def __getattr__(name: str):
    if name in __all__:
        from . import schemas

        return getattr(schemas, name)
    raise AttributeError(f"module 'contracts' has no attribute {name!r}")
