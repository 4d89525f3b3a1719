"""`runtime.tuning`: configs are frozen, hashable, and refuse a table field given something else."""

from dataclasses import replace

import pytest

from sparseblocks import attention, bsmm


def test_table_fields_are_read_only_and_hashable():
    cfg = replace(bsmm.DEFAULT, v7_wgrad_stacks={32: 2})
    assert hash(cfg) == hash(replace(bsmm.DEFAULT, v7_wgrad_stacks={32: 2})) and cfg != bsmm.DEFAULT
    with pytest.raises(TypeError, match="read-only"):
        cfg.v7_wgrad_stacks[64] = 2


@pytest.mark.parametrize("field", ["v7_wgrad_stacks", "v7_wgrad_pairs", "v7_groups"])
def test_a_table_field_given_a_number_names_itself(field):
    with pytest.raises(TypeError, match=f"{field}: expected a dict"):
        replace(bsmm.DEFAULT, **{field: 4})


def test_a_field_that_takes_a_table_or_a_number_takes_both():
    assert attention.AttentionConfig(hopper_forward_keys=64).wgmma_keys(128) == 64
