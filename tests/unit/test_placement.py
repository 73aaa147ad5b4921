"""Cluster placement: power-of-k choices over the edges' reported load, counting this replica's
own placements the reports cannot include yet."""

from __future__ import annotations

import random
import time
from collections import Counter

from dsec.control.placement import EdgeLoad, Placement


def edge(name: str, load: int, capacity: int = 10, substrates: tuple[str, ...] = ("container",),
         images: tuple[str, ...] = ("python-3.11",), healthy: bool = True, asked_at: float = 0.0) -> EdgeLoad:
    return EdgeLoad(name, load, capacity, list(substrates), list(images), asked_at, healthy)


def choose(placement: Placement, edges: list[EdgeLoad], exclude: frozenset[str] = frozenset(),
           count_sent: bool = True) -> str | None:
    chosen = placement.choose(edges, "container", "python-3.11", exclude, count_sent)
    return None if chosen is None else chosen.edge


def test_only_eligible_edges_are_chosen() -> None:
    placement = Placement(k=5, rng=random.Random(1))
    edges = [edge("sick", 0, healthy=False), edge("vm-only", 0, substrates=("vm",)),
             edge("full", 10), edge("excluded", 0), edge("ok", 9)]
    for _ in range(50):
        assert choose(placement, edges, exclude=frozenset({"excluded"})) == "ok"
    assert choose(placement, edges[:3]) is None


def test_an_edge_with_the_image_comes_first_and_any_edge_otherwise() -> None:
    placement = Placement(k=2, rng=random.Random(2))
    with_image, without = edge("has-image", 8), edge("no-image", 0, images=())
    assert {choose(placement, [with_image, without]) for _ in range(50)} == {"has-image"}
    # no edge knows the image: any may take it (and answer ImageNotFound itself)
    assert placement.choose([without], "container", "unknown-image") is not None


def test_the_least_loaded_of_the_sample_relative_to_capacity() -> None:
    placement = Placement(k=2, rng=random.Random(3))
    big_half_full, small_three_quarters = edge("big", 50, capacity=100), edge("small", 3, capacity=4)
    assert {choose(placement, [big_half_full, small_three_quarters]) for _ in range(20)} == {"big"}


def test_two_choices_never_pick_the_most_loaded_and_spread_over_the_rest() -> None:
    placement = Placement(k=2, rng=random.Random(4))
    edges = [edge(f"e{i}", load=i) for i in range(6)]  # e5 is the most loaded
    picks = Counter(choose(placement, edges) for _ in range(2000))
    assert "e5" not in picks
    assert set(picks) == {"e0", "e1", "e2", "e3", "e4"}
    # e0 wins every sample it is in: about 1 - (5/6 * 4/5) = 1/3 of them
    assert 0.25 < picks["e0"] / 2000 < 0.42
    assert picks["e0"] > picks["e1"] > picks["e2"] > picks["e3"] > picks["e4"]


def test_own_placements_count_until_a_report_includes_them() -> None:
    placement = Placement(k=2, rng=random.Random(5))
    before = time.monotonic()
    a, b = edge("a", 0, asked_at=before), edge("b", 2, asked_at=before)
    for _ in range(3):
        placement.sent("a")
    assert placement.estimate(a) == 3 and placement.estimate(a, count_sent=False) == 0
    assert choose(placement, [a, b]) == "b"
    placement.reported(a)  # asked for before the sends: they still count
    assert placement.estimate(a) == 3
    fresh = edge("a", 3, asked_at=time.monotonic())
    placement.reported(fresh)  # asked for after them: the report has them
    assert placement.estimate(fresh) == 3


def test_an_edge_full_by_estimate_can_still_be_tried_on_its_report_alone() -> None:
    placement = Placement(k=2, rng=random.Random(6))
    only = edge("only", 8, capacity=10)
    placement.sent("only")
    placement.sent("only")
    assert choose(placement, [only]) is None
    assert choose(placement, [only], count_sent=False) == "only"
