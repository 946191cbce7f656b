"""Facts the C code defines once, read by Python through cffi: the fields of a struct, the names of an enum.

The C headers (``src/*.h``, mirrored by ``cdef/``, which the compiler checks against them) are then the one
place where, say, the counters of the expert cache or the cost model's coefficients are listed; the Python
classes that carry the same values take their names from there instead of repeating them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import ArgumentTypeError
from . import CData, ffi

_C = TypeVar("_C", bound="Counters")


def struct_fields(struct: str) -> dict[str, type]:
    """The fields of C struct ``struct`` in declaration order, each with its Python type (float or int)."""
    return {name: float if f.type.cname in ("float", "double") else int for name, f in ffi.typeof(struct).fields}


def enum_names(enum: str, prefix: str) -> tuple[str, ...]:
    """The names of C enum ``enum`` by increasing value, without ``prefix``, lower-cased; ``{prefix}N`` (the
    count that closes such an enum) left out."""
    elements = ffi.typeof(enum).elements
    return tuple(elements[v].removeprefix(prefix).lower() for v in sorted(elements) if elements[v] != f"{prefix}N")


class Counters:
    """Counters whose fields are a C struct's: ``class X(Counters, struct="hy_..._counters")``.

    Every field starts at zero (0, or 0.0 for a double); ``from_c`` copies a struct, ``to_dict`` lists the
    fields in the struct's order, ``add`` sums another instance into this one.
    """

    _fields: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, struct: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._fields = struct_fields(struct)

    def __init__(self, **values: int | float) -> None:
        unknown = set(values) - set(self._fields)
        if unknown:
            raise ArgumentTypeError(f"{type(self).__name__}: no counter named {', '.join(sorted(unknown))}; "
                            f"the counters are {', '.join(self._fields)}")
        for name, kind in self._fields.items():
            setattr(self, name, values.get(name, kind()))

    if TYPE_CHECKING:  # the fields are set in __init__, from the struct: any name type-checks
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(cls._fields)

    @classmethod
    def from_c(cls: type[_C], c: CData) -> _C:
        """A copy of the C struct ``c`` (a cdata of the class's struct, or a pointer to one)."""
        return cls(**{name: getattr(c, name) for name in cls._fields})

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def add(self, other: Counters) -> None:
        for name in self._fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counters) and type(other) is type(self) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclasses they replace

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self._fields)})"
