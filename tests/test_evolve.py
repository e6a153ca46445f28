"""`specd.evolve`: dataclasses.replace's result, without calling __init__ again."""

import dataclasses

import pytest

from specd.evolve import evolve
from specd.policy.base import Estimates, PolicyState
from specd.policy.cost import pass_time


def test_evolve_equals_replace_and_derives_nothing_from_the_old_record():
    est = Estimates(verify_s=((0, 0.05), (4, 0.09)), calibrated_s=((0, 0.05), (4, 0.09)), draft_step_s=0.01)
    before = pass_time(est, 2)  # fills the old record's `derived`
    new = evolve(est, verify_s=((0, 0.10), (4, 0.18)), alpha=0.5)
    assert new == dataclasses.replace(est, verify_s=((0, 0.10), (4, 0.18)), alpha=0.5) and new is not est
    assert "derived" not in vars(new) and pass_time(new, 2) > before and pass_time(est, 2) == before
    assert est.alpha == 0.7  # the old record is untouched
    state = PolicyState()
    assert evolve(state, k=3, estimates=new) == dataclasses.replace(state, k=3, estimates=new)


def test_evolve_refuses_an_unknown_field_and_a_record_it_would_build_wrongly():
    with pytest.raises(TypeError, match="no field"):
        evolve(PolicyState(), kk=3)

    @dataclasses.dataclass(frozen=True)
    class Checked:
        n: int = 0

        def __post_init__(self):
            assert self.n >= 0

    with pytest.raises(TypeError, match="__post_init__"):
        evolve(Checked(), n=-1)
