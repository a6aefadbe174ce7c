"""core/record.py: the launcher's frozen records behave as frozen dataclasses do."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, asdict as dc_asdict, dataclass, field as dc_field
from typing import NamedTuple

import pytest

from hpcai.core.record import (FrozenRecordError, asdict, field, fields, named_tuple, record,
                               replace)


@record
class Point:
    """A record: two required fields, a default, a factory, one left out of the hash."""

    x: int
    y: int
    label: str = "p"
    tags: dict = field(default_factory=dict, hash=False)
    seen: tuple = field(default=())

    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)


@dataclass(frozen=True)
class DcPoint:
    """The same fields as a frozen dataclass: the behaviour to match."""

    x: int
    y: int
    label: str = "p"
    tags: dict = dc_field(default_factory=dict, hash=False)
    seen: tuple = dc_field(default=())


class Pair(NamedTuple):
    a: object
    b: object


@record
class Checked:
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("negative")


@pytest.mark.parametrize("cls", [Point, DcPoint], ids=["record", "dataclass"])
def test_a_record_is_built_compared_and_frozen_as_a_frozen_dataclass(cls):
    p = cls(1, y=2)
    assert (p.x, p.y, p.label, p.tags, p.seen) == (1, 2, "p", {}, ())
    assert cls(1, 2) == p and cls(1, 3) != p and hash(cls(1, 2)) == hash(p)
    assert cls(1, 2).tags is not p.tags                      # a factory per instance
    assert hash(cls(1, 2, tags={"a": "b"})) == hash(p)       # tags not hashed ...
    assert cls(1, 2, tags={"a": "b"}) != p                   # ... but compared
    assert repr(cls(1, 2)).endswith("(x=1, y=2, label='p', tags={}, seen=())")
    with pytest.raises(AttributeError):
        p.x = 5
    with pytest.raises(AttributeError):
        del p.y
    with pytest.raises(TypeError):
        cls(1)                          # y missing
    with pytest.raises(TypeError):
        cls(1, 2, z=3)                  # no such field
    with pytest.raises(TypeError):
        cls(1, 2, x=1)                  # x twice
    with pytest.raises(TypeError):
        cls(1, 2, "q", {}, (), 6)       # too many


def test_assignment_raises_the_records_own_error():
    with pytest.raises(FrozenRecordError):
        Point(1, 2).label = "q"
    assert issubclass(FrozenRecordError, AttributeError)
    assert not issubclass(FrozenInstanceError, FrozenRecordError)


def test_replace_asdict_and_fields_match_dataclasses():
    p = Point(1, 2, seen=(Point(3, 4),))
    d = DcPoint(1, 2, seen=(DcPoint(3, 4),))
    assert asdict(p) == dc_asdict(d)
    nested = asdict({"k": [Pair(Point(0, 1), 2)]})
    assert nested == {"k": [Pair({"x": 0, "y": 1, "label": "p", "tags": {}, "seen": ()}, 2)]}
    q = replace(p, y=7)
    assert (q.x, q.y, q.seen) == (1, 7, p.seen) and p.y == 2 and q.norm1() == 8
    with pytest.raises(TypeError):
        replace(p, z=1)
    assert [f.name for f in fields(Point)] == ["x", "y", "label", "tags", "seen"]
    assert [f.name for f in fields(p)] == [f.name for f in fields(Point)]


def test_post_init_runs_on_construction_and_on_replace():
    assert Checked(3).n == 3
    with pytest.raises(ValueError):
        Checked(-1)
    with pytest.raises(ValueError):
        replace(Checked(3), n=-2)


def test_a_record_equals_no_other_class_with_the_same_values():
    assert Point(1, 2) != DcPoint(1, 2) and Point(1, 2) != (1, 2, "p", {}, ())


@named_tuple
class Span:
    """A named tuple made by the decorator."""

    start: int
    stop: int = 10
    label: str = ""

    def size(self) -> int:
        return self.stop - self.start


class TypedSpan(NamedTuple):
    """The same fields through typing.NamedTuple: the behaviour to match."""

    start: int
    stop: int = 10
    label: str = ""

    def size(self) -> int:
        return self.stop - self.start


@pytest.mark.parametrize("cls", [Span, TypedSpan], ids=["named_tuple", "typing"])
def test_named_tuple_behaves_as_typing_namedtuple(cls):
    s = cls(2)
    assert s == (2, 10, "") and s.size() == 8 and cls._fields == ("start", "stop", "label")
    assert s._replace(stop=4) == cls(2, 4) and cls._field_defaults == {"stop": 10, "label": ""}
    assert list(s) == [2, 10, ""] and cls(*[2, 10, ""]) == s     # a JSON array round trip
    assert cls.__doc__.endswith("to match.") or cls.__doc__.startswith("A named tuple")
    assert cls.__name__ == cls.__qualname__ and cls.__module__ == __name__
    with pytest.raises(AttributeError):
        s.start = 3


def test_named_tuple_refuses_a_required_field_after_a_default():
    with pytest.raises(TypeError, match="without a default follows"):
        @named_tuple
        class Bad:
            a: int = 1
            b: int
