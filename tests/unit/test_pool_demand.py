"""How a warm pool sizes itself after bursts (``edge/pool.py: Demand``): a burst is the
creates within BURST_S of each other; its size is kept for the hold after the last burst
that reached it, then forgotten; a smaller burst meanwhile does not extend the hold."""

from dsec.edge.pool import BURST_S, Demand


def test_a_burst_is_remembered_for_the_hold_then_forgotten() -> None:
    demand = Demand(hold_s=60)
    for i in range(100):
        demand.add(1000 + i * 0.01)
    assert demand.peak(1001) == 100
    assert demand.peak(1000.99 + 60) == 100
    assert demand.peak(1001 + 60) == 0


def test_creates_far_apart_are_no_burst() -> None:
    demand = Demand(hold_s=60)
    for i in range(10):
        demand.add(1000 + i * (BURST_S + 1))
    assert demand.peak(1000 + 9 * (BURST_S + 1)) == 1


def test_a_repeated_burst_extends_the_hold_and_a_smaller_one_does_not() -> None:
    demand = Demand(hold_s=60)
    for i in range(50):
        demand.add(1000 + i * 0.01)
    for i in range(50):  # the next training step, 40 s later: as large
        demand.add(1040 + i * 0.01)
    assert demand.peak(1095) == 50
    for i in range(10):  # a small one
        demand.add(1090 + i * 0.01)
    assert demand.peak(1091) == 50
    assert demand.peak(1040.5 + 60) == 0  # the large one's hold ended: forgotten
    demand.add(1200)
    assert demand.peak(1200) == 1
