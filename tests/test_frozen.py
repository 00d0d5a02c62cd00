"""FrozenRecord: what the store's records and the workspace kept from being frozen dataclasses."""

from __future__ import annotations

import pickle

import pytest

from pipeline.frozen import FrozenRecord
from pipeline.lifecycle import CaseRecord, Checkpoint
from pipeline.workspace import Workspace


class Pair(FrozenRecord):
    __slots__ = ("left", "right")


def test_built_by_position_or_keyword_and_equal_by_type_and_values():
    assert Pair(1, 2) == Pair(left=1, right=2) == Pair(1, right=2)
    assert Pair(1, 2) != Pair(2, 1)
    assert hash(Pair(1, 2)) == hash(Pair(left=1, right=2))
    assert len({Pair(1, 2), Pair(1, 2), Pair(1, 3)}) == 2

    class Other(FrozenRecord):
        __slots__ = ("left", "right")

    assert Pair(1, 2) != Other(1, 2)
    assert Pair(1, 2) != (1, 2)


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, 2, 3), {}), ((1, 2), {"left": 1}), ((), {"left": 1, "middle": 2})])
def test_wrong_arguments_are_type_errors(args, kwargs):
    with pytest.raises(TypeError):
        Pair(*args, **kwargs)


def test_fields_cannot_be_assigned_deleted_or_added():
    pair = Pair(1, 2)
    with pytest.raises(AttributeError):
        pair.left = 3
    with pytest.raises(AttributeError):
        del pair.left
    with pytest.raises(AttributeError):
        pair.other = 3
    assert pair == Pair(1, 2)


def test_repr_names_every_field_and_pickling_round_trips():
    assert repr(Pair(1, "x")) == "Pair(left=1, right='x')"
    record = CaseRecord("c1", "p1", "VALIDATED", 1, 2, None, False)
    assert pickle.loads(pickle.dumps(record)) == record
    assert record.state == "VALIDATED" and record.case_built is False
    checkpoint = Checkpoint(1, "c1", "admit", "admit", None, None, 1, 1, "VALIDATED", ("a",), None, "t")
    assert pickle.loads(pickle.dumps(checkpoint)) == checkpoint


def test_a_workspace_is_absolute_and_compares_by_its_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Workspace("ws") == Workspace(tmp_path / "ws") == Workspace(root=str(tmp_path / "ws"))
    assert Workspace("ws").root.is_absolute()
    assert pickle.loads(pickle.dumps(Workspace("ws"))) == Workspace("ws")
    with pytest.raises(AttributeError):
        Workspace("ws").root = tmp_path
