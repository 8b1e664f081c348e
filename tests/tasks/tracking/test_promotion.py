"""The paired promotion test (tasks/tracking/promotion.py) against p-values computed another way: by counting the
sign sequences of the discordant rows one by one, and with scipy's exact binomial test."""

import itertools

import pytest
from scipy.stats import binomtest

from grpoflow.tasks.tracking.promotion import mcnemar_exact_p, paired_promotion


def enumerated_p(b: int, c: int) -> float:
    """Two-sided p by brute force: of the 2^n equally likely ways n = b + c discordant rows fall (candidate or
    champion), the share at least as lopsided as the one seen."""
    n = b + c
    extreme = abs(b - c)
    ways = itertools.product((1, -1), repeat=n)
    return sum(abs(sum(w)) >= extreme for w in ways) / 2**n if n else 1.0


@pytest.mark.parametrize("b,c", [(0, 0), (1, 0), (0, 1), (3, 3), (5, 0), (6, 0), (7, 2), (2, 9), (10, 4), (12, 1)])
def test_p_value_matches_counting_and_scipy(b, c):
    p = mcnemar_exact_p(b, c)
    assert p == pytest.approx(enumerated_p(b, c), rel=1e-12)
    if b + c:
        assert p == pytest.approx(binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


def test_known_values():
    assert mcnemar_exact_p(6, 0) == 2 / 64  # every discordant row went the candidate's way
    assert mcnemar_exact_p(5, 0) == 2 / 32
    assert mcnemar_exact_p(15, 5) == 2 * (1 + 20 + 190 + 1140 + 4845 + 15504) / 2**20  # C(20, 0..5), by hand
    assert mcnemar_exact_p(14, 5) > 0.05  # so at alpha 0.05 with 5 rows lost it takes 15 gained
    assert mcnemar_exact_p(40, 40) == 1.0  # symmetric: capped at 1
    assert mcnemar_exact_p(300, 260) == pytest.approx(binomtest(300, 560, 0.5).pvalue, rel=1e-9)  # big n, exact ints
    with pytest.raises(ValueError, match="b=-1"):
        mcnemar_exact_p(-1, 2)


def rows(pairs: list[tuple[bool, bool]], times: int = 1) -> tuple[list[bool], list[bool]]:
    """(champion correct, candidate correct) per row, ``times`` over."""
    return [p[0] for p in pairs] * times, [p[1] for p in pairs] * times


def test_promotes_on_a_significant_gain_and_tags_the_figures():
    # 100 rows: 30 both right, 40 both wrong, 20 gained, 10 lost -> p = 0.0987: not enough at 0.05
    champion, candidate = rows(
        [(True, True)] * 30 + [(False, False)] * 40 + [(False, True)] * 20 + [(True, False)] * 10
    )
    d = paired_promotion(champion, candidate, alpha=0.05)
    assert (d.rows, d.b, d.c) == (100, 20, 10)
    assert d.accuracy_champion == 0.40 and d.accuracy_candidate == 0.50
    assert d.p_value == pytest.approx(binomtest(20, 30, 0.5).pvalue) and d.p_value > 0.05
    assert not d.promote and "within the held-out noise" in d.reason
    assert paired_promotion(champion, candidate, alpha=0.1).promote  # a looser alpha takes it
    # 24 gained, 6 lost: p = 0.0014
    champion, candidate = rows([(True, True)] * 30 + [(False, False)] * 40 + [(False, True)] * 24 + [(True, False)] * 6)
    d = paired_promotion(champion, candidate, alpha=0.05)
    assert d.promote and d.p_value < 0.01 and "promoted" in d.reason
    tags = d.tags()
    assert tags["promotion.b"] == "24" and tags["promotion.c"] == "6" and tags["promotion.alpha"] == "0.05"
    assert tags["promotion.decision"] == "promoted" and float(tags["promotion.p_value"]) == pytest.approx(
        d.p_value, rel=1e-5
    )
    assert float(tags["promotion.accuracy_candidate"]) == 0.54 and float(tags["promotion.accuracy_champion"]) == 0.36


def test_no_discordant_rows_or_a_loss_keep_the_champion():
    same = paired_promotion([True, False, True], [True, False, True], alpha=0.05)  # b = c = 0
    assert (same.b, same.c, same.p_value, same.promote) == (0, 0, 1.0, False) and "no gain" in same.reason
    # a significant loss is no reason to promote, however small p is
    champion, candidate = rows([(True, False)], times=20)
    worse = paired_promotion(champion, candidate, alpha=0.05)
    assert worse.c == 20 and worse.p_value < 1e-5 and not worse.promote
    # one row gained is no evidence (p = 1); three of three give p = 0.25; a tie never promotes
    assert paired_promotion([False], [True], alpha=0.5).p_value == 1.0
    assert paired_promotion([False] * 3, [True] * 3, alpha=0.3).promote
    assert not paired_promotion([False, True], [True, False], alpha=1.0).promote


def test_rows_must_pair_up():
    with pytest.raises(ValueError, match="2 champion rows vs 3 candidate rows"):
        paired_promotion([True, False], [True, False, True], alpha=0.05)
    with pytest.raises(ValueError, match="no held-out rows"):
        paired_promotion([], [], alpha=0.05)
    with pytest.raises(ValueError, match="promotion_alpha"):
        paired_promotion([True], [True], alpha=0.0)


def test_a_row_unscored_for_either_model_is_out_of_the_pair():
    """None: the reward did not score that row for that model (a sandbox failure); the row pairs with nothing."""
    got = paired_promotion([True, None, False, False], [True, True, None, True], alpha=0.5)
    assert (got.rows, got.b, got.c) == (2, 1, 0)
    with pytest.raises(ValueError, match="no held-out rows"):
        paired_promotion([None], [True], alpha=0.5)
