"""The k× tolerance helper passes good results, fails bad ones, and names the worst element."""

import pytest
import torch

from fusedattn.testing import assert_close_kx, compare_kx, poisoned_like


def _case(dtype=torch.bfloat16):
    ref = torch.randn(4, 5, dtype=torch.float64)
    baseline = ref.to(dtype)
    return ref, baseline


def test_a_result_as_good_as_the_baseline_passes():
    ref, baseline = _case()
    result = assert_close_kx(baseline.clone(), ref, baseline)
    assert result.ok and result.error == result.baseline_error


def test_a_wrong_element_fails_with_its_index_values_and_share():
    ref, baseline = _case()
    out = baseline.clone()
    out[2, 3] += 1.0
    with pytest.raises(AssertionError, match=r"at index \(2, 3\)") as info:
        assert_close_kx(out, ref, baseline, name="dq")
    message = str(info.value)
    assert message.startswith("dq: max error") and "5.00% of 20 elements fail" in message


def test_nan_and_unwritten_elements_fail_but_matching_infinities_pass():
    ref, baseline = _case(torch.float32)
    out = baseline.clone()
    out[0, 0] = float("nan")
    assert not compare_kx(out, ref, baseline).ok
    assert not compare_kx(poisoned_like(baseline), ref, baseline).ok
    ref[1, 1] = baseline[1, 1] = float("-inf")
    out = baseline.clone()
    assert compare_kx(out, ref, baseline).ok


def test_k_scales_the_allowance():
    ref = torch.zeros(10, dtype=torch.float64)
    baseline = torch.full((10,), 0.01)
    out = torch.full((10,), 0.025)
    assert not compare_kx(out, ref, baseline, k=2, atol=0).ok
    assert compare_kx(out, ref, baseline, k=3, atol=0).ok


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes differ"):
        compare_kx(torch.zeros(3), torch.zeros(4), torch.zeros(3))
