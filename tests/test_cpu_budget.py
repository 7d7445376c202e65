"""The scaled CPU budget (tests/cpu_budget.py) still fails a slow function and passes a quick one."""
from tests.cpu_budget import REFERENCE_HERE_S, cpu_within, machine_scale, reference_workload


def test_scale_is_at_least_one_and_follows_the_reference():
    s = machine_scale()
    assert s >= 1.0
    assert reference_workload() < 20 * REFERENCE_HERE_S * s  # the same loop, within noise of what scaled it


def test_a_function_over_its_budget_fails_and_one_under_passes():
    took, allowed, _ = cpu_within(lambda: [reference_workload() for _ in range(8)], 2 * REFERENCE_HERE_S, tries=2)
    assert took > allowed  # eight references never fit two references' budget, however slow the machine
    took, allowed, out = cpu_within(lambda: sum(range(1000)), 2 * REFERENCE_HERE_S)
    assert took < allowed and out == 499500
