"""bench.ring_bound's formula: what a ring of stages on one machine could deliver for N users."""

import pytest

from bench.ring_bound import bound, ring_compute_ms

# two stages, each a step of b rows: 2 ms + 0.5 ms a row (measured at 1, 4 and 8 rows)
COSTS = [{1: 2.5, 4: 4.0, 8: 6.0}, {1: 2.5, 4: 4.0, 8: 6.0}]


def test_compute_takes_the_measured_row_count_at_or_above():
    assert ring_compute_ms(COSTS, 1) == 5.0
    assert ring_compute_ms(COSTS, 3) == 8.0  # a 3-row batch priced as the measured 4
    assert ring_compute_ms(COSTS, 16) == pytest.approx(24.0)  # above 8: the 8-row step scaled


def test_without_network_one_batch_of_every_user_is_best():
    b = bound(COSTS, 8, network_ms=0.0)
    assert (b["groups"], b["rows"]) == (1, 8) and b["tok_s"] == pytest.approx(8 / 12.0 * 1000)


def test_a_long_trip_is_filled_with_more_batches():
    # one batch of 8: 12 ms compute + 60 ms away = 72 ms a round; 8 batches of 1 keep the machine
    # busier: max(8 * 5, 5 + 60) = 65 ms a round
    b = bound(COSTS, 8, network_ms=60.0)
    assert b["groups"] > 1 and b["tok_s"] > 8 / 72.0 * 1000
    best = max(8 / max(g * ring_compute_ms(COSTS, -(-8 // g)), ring_compute_ms(COSTS, -(-8 // g)) + 60.0)
               for g in range(1, 9))
    assert b["tok_s"] == pytest.approx(best * 1000)
