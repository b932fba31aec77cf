"""Layer-skip self-speculation's layer lists and the tuner's estimate, by hand (the
draft itself: tests/test_spec_decode.py)."""

from __future__ import annotations

import pytest

from tandem.errors import InvalidParameterError
from tandem.spec_decode.layer_skip import default_layers, format_layers, parse_layers
from tandem.train.layer_skip_tuning import candidate_sets, estimated_speedup


def test_layer_lists_parse_and_print_as_ranges():
    assert parse_layers("4-7, 10,12-12", 16) == {4, 5, 6, 7, 10, 12}
    assert format_layers({4, 5, 6, 7, 10, 12}) == "4-7,10,12"
    for bad in ("x", "3-1", "16", "0-15", ""):
        with pytest.raises(InvalidParameterError, match="skip_layers"):
            parse_layers(bad, 16)


def test_the_default_skips_the_middle_half_and_never_all():
    assert default_layers(30) == set(range(7, 23))
    assert default_layers(2) == {1} and default_layers(3) == {1}


def test_the_estimate_is_tokens_per_step_over_its_time():
    # a = 0.5, c = 0.25: k = 1 gives 1.5 tokens in 1.25 steps; k = 2 gives 1.75 in 1.5;
    # k = 3: 1.875 in 1.75. The best is k = 1 (1.2x).
    assert estimated_speedup(0.5, 0.25) == (1, pytest.approx(1.2))
    assert estimated_speedup(1.0, 0.0)[1] == pytest.approx(9.0)  # every guess holds, free
    assert estimated_speedup(0.0, 0.5)[1] < 1.0


def test_candidates_never_skip_every_layer():
    for layers in (2, 4, 30):
        sets = candidate_sets(layers)
        assert sets and all(0 < len(s) < layers for s in sets)
        early_exits = [s for s in sets if s == frozenset(range(min(s), layers))]
        assert early_exits  # the first L layers, then the final norm and the LM head
