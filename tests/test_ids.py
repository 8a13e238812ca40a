from __future__ import annotations

import pytest

from cedana_airflow.errors import CheckpointIdError
from cedana_airflow.ids import MAX_ID_LENGTH, derive_checkpoint_id, validate_checkpoint_id


@pytest.mark.parametrize("ok", ["a", "train-1", "dag.task.run", "x=1+y@z", "A" * MAX_ID_LENGTH])
def test_safe_ids_pass_unchanged(ok):
    assert validate_checkpoint_id(ok) == ok


@pytest.mark.parametrize("bad", ["", "..", "../x", "a/../b", "a/b", "/abs", ".hidden", "-flag", "a..b", "a b",
                                 "a\x00b", "chunks", "leases", "store.json", "é", "A" * (MAX_ID_LENGTH + 1)])
def test_unsafe_ids_are_refused(bad):
    with pytest.raises(CheckpointIdError):
        validate_checkpoint_id(bad)


def test_derived_id_is_stable_for_a_run_and_new_for_the_next():
    a = derive_checkpoint_id("train", "fit", "manual__2026-11-29T10:00:00+00:00")
    assert a == derive_checkpoint_id("train", "fit", "manual__2026-11-29T10:00:00+00:00")
    assert a != derive_checkpoint_id("train", "fit", "manual__2026-11-30T10:00:00+00:00")
    assert a != derive_checkpoint_id("train", "fit", "manual__2026-11-29T10:00:00+00:00", map_index=0)
    assert validate_checkpoint_id(a) == a and ":" not in a


def test_derived_ids_differing_only_in_unsafe_characters_stay_apart():
    assert derive_checkpoint_id("d", "t", "r:1") != derive_checkpoint_id("d", "t", "r/1")


def test_derived_id_of_hostile_names_is_safe_and_bounded():
    cid = derive_checkpoint_id("../../etc", "passwd/" * 100, "..")
    assert validate_checkpoint_id(cid) == cid and len(cid) <= MAX_ID_LENGTH
