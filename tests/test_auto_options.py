"""``commpress.auto.Options``: the typed ``"auto"`` options (issue 51's spelling of AutoSpec)."""

from __future__ import annotations

import pytest

import commpress.auto
from commpress.auto.runtime import AutoSpec


def test_auto_options_is_the_typed_spelling():
    assert commpress.auto.Options is AutoSpec
    assert commpress.auto.Options(check_every=4).check_every == 4
    with pytest.raises((TypeError, ValueError), match="check_every"):
        commpress.auto.Options(check_every=0)
