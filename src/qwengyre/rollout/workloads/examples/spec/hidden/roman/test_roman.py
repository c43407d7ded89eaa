"""Hidden tests of the roman task: copied into the workspace only at grading."""

from roman import from_roman, to_roman


def test_to_roman():
    assert [to_roman(n) for n in (1, 4, 9, 14, 40, 90, 400, 1994, 3999)] == [
        "I",
        "IV",
        "IX",
        "XIV",
        "XL",
        "XC",
        "CD",
        "MCMXCIV",
        "MMMCMXCIX",
    ]


def test_round_trip():
    assert all(from_roman(to_roman(n)) == n for n in range(1, 4000))
