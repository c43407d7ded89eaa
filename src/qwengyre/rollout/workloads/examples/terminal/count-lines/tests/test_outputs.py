"""The count-lines verifier's checks (run in the workspace the harness left)."""

from pathlib import Path


def test_count_file_exists():
    assert Path("count.txt").is_file()


def test_count_is_the_number_of_records():
    assert Path("count.txt").read_text().strip() == "4"
