"""Immutable value records without the cost of ``dataclass``.

``@dataclass(frozen=True)`` writes and compiles its methods when the class
is made, about a millisecond a class: every doit run pays that for the
records it imports (the workspace, the store's records), a no-op rebuild
included. A subclass here names its fields in ``__slots__`` and gets what
those dataclasses gave: construction by position or keyword, equality and
hashing by type and values, a readable repr, and no assignment after
construction.
"""

from __future__ import annotations

__all__ = ["FrozenRecord"]


class FrozenRecord:
    __slots__ = ()

    def __init__(self, *args, **kwargs) -> None:
        fields = self.__slots__
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__}() takes {len(fields)} arguments, {len(args)} given")
        values = dict(zip(fields, args))
        for name, value in kwargs.items():
            if name not in fields:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__}() got multiple values for argument {name!r}")
            values[name] = value
        missing = [name for name in fields if name not in values]
        if missing:
            raise TypeError(f"{type(self).__name__}() missing arguments: {', '.join(missing)}")
        for name in fields:
            object.__setattr__(self, name, values[name])

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name, value) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")

    def __delattr__(self, name) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({inner})"

    def __reduce__(self):
        # Pickle by position: the default would restore slots by setattr.
        return type(self), self._values()
