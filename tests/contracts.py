"""What the contract suites share: one parameter per implementation of an interface,
those a case does not apply to marked with the reason."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def implementations(names: Iterable[str], **cannot: str) -> list[Any]:
    """A parameter per name; ``cannot`` maps the names a case does not apply to (a
    ``-`` in a name written ``_``) to the reason, which their skip shows."""
    names = list(names)
    reasons = {name.replace("_", "-"): why for name, why in cannot.items()}
    assert set(reasons) <= set(names), f"no such implementation: {set(reasons) - set(names)}"
    return [
        pytest.param(name, marks=pytest.mark.skip(reason=reasons[name]))
        if name in reasons
        else name
        for name in names
    ]
