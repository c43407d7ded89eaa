"""Hidden tests of the textstats task: copied into the workspace only at grading."""

from textstats import top_words, word_count


def test_word_count_counts_words():
    assert word_count("The cat, the hat.") == 4


def test_word_count_of_nothing_is_zero():
    assert word_count("  ... ") == 0


def test_top_words_orders_by_count_then_name():
    assert top_words("b a b c a b", 2) == [("b", 3), ("a", 2)]


def test_top_words_ignores_case_and_keeps_apostrophes():
    assert top_words("Don't don't DON'T stop", 5) == [("don't", 3), ("stop", 1)]
