"""Frozen records for the launcher's values, built without compiling code per class.

``@record`` makes a class with annotated fields an immutable value, as
``@dataclass(frozen=True)`` does: an ``__init__`` taking the fields by position or name (then
``__post_init__`` if the class has one), ``__repr__``, ``__eq__`` and ``__hash__`` over the
fields unless the class writes its own, and assignment refused. The methods are shared
functions reading the class's field table, where dataclasses compile six functions for
every class and import ``inspect``: for the 30 or so value types that ``hpcai-launch``
imports before it starts anything, that was about a third of its start-up. :func:`replace`, :func:`asdict` and :func:`fields` work as
their dataclasses namesakes do, on records. ``@named_tuple`` makes a class with annotated
fields a named tuple, as subclassing ``typing.NamedTuple`` does, for records that travel as
JSON arrays; ``typing`` stays unimported (about 5 ms of a launch).
"""

from __future__ import annotations

import collections

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from typing import Any, Callable

_MISSING: Any = object()


def named_tuple(cls: type) -> type:
    """``cls``'s annotated fields (defaults from the class body) as a named tuple class,
    with the rest of the body (methods, docstring) on it."""
    names = tuple(cls.__dict__.get("__annotations__", {}))
    defaults = [cls.__dict__[name] for name in names if name in cls.__dict__]
    if any(name not in cls.__dict__ for name in names[len(names) - len(defaults):]):
        raise TypeError(f"{cls.__name__}: a field without a default follows one with")
    made = collections.namedtuple(cls.__name__, names, defaults=defaults,
                                  module=cls.__module__)
    for key, value in cls.__dict__.items():
        if key not in names and key not in ("__dict__", "__weakref__") and not (
                key == "__doc__" and value is None):
            setattr(made, key, value)
    made.__qualname__ = cls.__qualname__
    return made


@named_tuple
class Field:
    name: str
    default: Any = _MISSING          # _MISSING: required (or made by ``factory``)
    factory: Callable[[], Any] | None = None
    hash: bool = True                # counted in ``__hash__``


@named_tuple
class _Spec:
    """What ``field(...)`` puts in the class body until ``@record`` reads it."""

    default: Any
    factory: Callable[[], Any] | None
    hash: bool


class FrozenRecordError(AttributeError):
    """Assignment to a field of a record."""


def field(*, default: Any = _MISSING, default_factory: Callable[[], Any] | None = None,
          hash: bool = True) -> Any:
    """A field's default (or a factory called per instance), and whether ``__hash__``
    counts it."""
    return _Spec(default, default_factory, hash)


def record(cls: type) -> type:
    """Make ``cls`` a frozen record of its annotated fields, in their order."""
    table: list[Field] = []
    for name, note in cls.__dict__.get("__annotations__", {}).items():
        if str(note).startswith(("ClassVar", "typing.ClassVar")):
            continue
        given = cls.__dict__.get(name, _MISSING)
        if isinstance(given, _Spec):
            table.append(Field(name, given.default, given.factory, given.hash))
            if given.default is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, given.default)
        else:
            table.append(Field(name, given))
    cls.__record_fields__ = tuple(table)
    cls.__record_names__ = tuple(f.name for f in table)
    own = cls.__dict__
    cls.__init__ = _init
    if "__repr__" not in own:
        cls.__repr__ = _repr
    if "__eq__" not in own:
        cls.__eq__ = _eq
    if own.get("__hash__") is None:       # not written in the class (or unset by __eq__)
        cls.__hash__ = _hash
    cls.__setattr__ = _refuse
    cls.__delattr__ = _refuse
    return cls


def _init(self, *args: Any, **kwargs: Any) -> None:
    table = type(self).__record_fields__
    if len(args) > len(table):
        raise TypeError(f"{type(self).__name__}() takes {len(table)} arguments, "
                        f"got {len(args)}")
    values = self.__dict__
    for f, value in zip(table, args):
        values[f.name] = value
    for f in table[len(args):]:
        if f.name in kwargs:
            values[f.name] = kwargs.pop(f.name)
        elif f.factory is not None:
            values[f.name] = f.factory()
        elif f.default is not _MISSING:
            values[f.name] = f.default
        else:
            raise TypeError(f"{type(self).__name__}() missing argument {f.name!r}")
    if kwargs:
        name = next(iter(kwargs))
        why = "got multiple values for" if name in values else "got an unexpected argument"
        raise TypeError(f"{type(self).__name__}() {why} {name!r}")
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


def _values(self) -> tuple:
    values = self.__dict__
    return tuple(values[name] for name in type(self).__record_names__)


def _repr(self) -> str:
    inner = ", ".join(f"{f.name}={self.__dict__[f.name]!r}"
                      for f in type(self).__record_fields__)
    return f"{type(self).__qualname__}({inner})"


def _eq(self, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _values(self) == _values(other)


def _hash(self) -> int:
    values = self.__dict__
    return hash(tuple(values[f.name] for f in type(self).__record_fields__ if f.hash))


def _refuse(self, name: str, *_: Any) -> None:
    raise FrozenRecordError(f"cannot assign to field {name!r} of a frozen record")


def is_record(obj: object) -> bool:
    return hasattr(obj, "__record_fields__")


def fields(obj: object) -> tuple[Field, ...]:
    """The fields of a record or record class."""
    return obj.__record_fields__  # type: ignore[attr-defined]


def replace(obj: Any, **changes: Any) -> Any:
    """A new record like ``obj`` with ``changes`` (``__post_init__`` runs again)."""
    values = {name: obj.__dict__[name] for name in type(obj).__record_names__}
    unknown = changes.keys() - values.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    values.update(changes)
    return type(obj)(**values)


def asdict(obj: Any) -> Any:
    """Records as dicts of their fields, recursively through lists, tuples and dicts."""
    if is_record(obj) and not isinstance(obj, type):
        return {name: asdict(obj.__dict__[name]) for name in type(obj).__record_names__}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(asdict(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(asdict(v) for v in obj)
    if isinstance(obj, dict):
        return {asdict(k): asdict(v) for k, v in obj.items()}
    return obj
