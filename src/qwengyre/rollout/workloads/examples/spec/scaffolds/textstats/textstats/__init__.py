"""textstats: word statistics of a text (to be written from the specification)."""


def word_count(text: str) -> int:
    raise NotImplementedError


def top_words(text: str, n: int) -> list[tuple[str, int]]:
    raise NotImplementedError
