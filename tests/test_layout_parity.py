"""The layout-parity check itself (tests/layout_parity.py): a comparison asked for fails when a side lacks
what it compares, instead of passing silently. Synthetic runs: nothing trains here."""

import numpy as np
import pytest

from layout_parity import Run, assert_same_run

LOSSES, NORMS = np.array([5.0, 4.0, 3.0]), np.array([2.0, 1.5, 1.0])
PARAMS = {f"p{i}": np.full(3, float(i)) for i in range(6)}
MOE = {"moe_aux_loss": np.array([1.0, 1.0, 1.0])}


def dense(params=True):
    return Run(LOSSES.copy(), NORMS.copy(), dict(PARAMS) if params else None)


def moe(metrics=True, bias=None):
    return Run(LOSSES.copy(), NORMS.copy(), dict(PARAMS), dict(MOE) if metrics else None, bias,
               mixture_of_experts=True)


def test_equal_runs_pass_and_what_is_not_asked_for_is_said():
    assert_same_run(dense(), dense())
    assert_same_run(dense(params=False), dense(), params=False)
    assert_same_run(moe(), moe())
    assert_same_run(moe(metrics=False), moe(), moe=False)
    assert_same_run(moe().first(2), moe().first(2))


@pytest.mark.parametrize("got, ref, message", [
    (dense(params=False), dense(), "the run has no parameters after step 1"),
    (dense(), dense(params=False), "the reference has no parameters after step 1"),
    (moe(metrics=False), moe(), "the run has no MoE metrics"),
    (moe(), moe(metrics=False), "the reference has no MoE metrics"),
    (moe(bias=np.zeros((2, 4))), moe(), "the reference has no expert bias"),
    (moe(), moe(bias=np.zeros((2, 4))), "the run has no expert bias"),
    (dense(), moe(), "comparing a dense run with a MoE reference"),
])
def test_a_missing_side_fails(got, ref, message):
    with pytest.raises(pytest.fail.Exception, match=message):
        assert_same_run(got, ref)


def test_a_different_run_fails():
    other = dense()
    other.params1["p3"] = other.params1["p3"] + 1e-3
    with pytest.raises(AssertionError, match="parameter p3 after step 1"):
        assert_same_run(other, dense())
    other = moe()
    other.moe["moe_aux_loss"] = other.moe["moe_aux_loss"] * 1.01
    with pytest.raises(AssertionError, match="moe_aux_loss per step"):
        assert_same_run(other, moe())
