"""``commpress.auto.Options``: the typed ``"auto"`` options (issue 51's spelling of AutoSpec)."""

from __future__ import annotations

import pytest

import commpress
import commpress.auto
from commpress.auto.runtime import AutoSpec


def test_auto_options_is_the_typed_spelling():
    assert commpress.auto.Options is AutoSpec
    assert commpress.auto.Options(check_every=4).check_every == 4
    with pytest.raises((TypeError, ValueError), match="check_every"):
        commpress.auto.Options(check_every=0)


def test_fsdp_takes_the_typed_options_and_warns_on_the_old_spelling():
    """``FSDPState("auto", auto=Options(...))`` as for DDP: validated, refused twice, refused with
    another compressor or with a kind FSDP2 cannot run; the keyword spelling warns."""
    import warnings

    from commpress.hooks.fsdp import FSDPState

    state = FSDPState("auto", auto=commpress.auto.Options(check_every=7), momentum=0.9)
    assert state.compressor.check_every == 7 and state.momentum == 0.9
    assert all(c.kind != "powersgd" for c in state.compressor.candidates)   # the default set, FSDP2's
    with pytest.raises(ValueError, match="given twice"):
        FSDPState("auto", auto=commpress.auto.Options(), check_every=3)
    with pytest.raises(ValueError, match="auto="):
        FSDPState("topk", ratio=0.01, auto=commpress.auto.Options())
    with pytest.raises(ValueError, match="cannot run in FSDP2"):
        FSDPState("auto", auto=commpress.auto.Options(candidates=[("powersgd", 4)]))
    with pytest.raises(TypeError, match="commpress.auto.Options"):
        FSDPState("auto", auto={"check_every": 3})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        old = FSDPState("auto", check_every=5)
    assert old.compressor.check_every == 5
    assert any(issubclass(w.category, DeprecationWarning) and "auto=commpress.auto.Options" in str(w.message)
               for w in seen)


def test_an_error_feedback_instance_carries_its_own_options():
    """Error-feedback options given on ``ErrorFeedback`` itself: the hook runs that instance."""
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.01), momentum=0.9, storage="int8")
    state = commpress.ddp.DDPState(ef)
    assert state.codec is ef and state.uses_error_feedback and state.momentum == 0.9


def test_fsdp_state_internals_are_private():
    """FSDPState's internals read through their old public names still work, with a DeprecationWarning."""
    from commpress.hooks.fsdp import FSDPState

    state = FSDPState("topk", ratio=0.01)
    for name in ("units", "transaction", "all_gather_compressor", "replicate"):
        with pytest.warns(DeprecationWarning, match=f"FSDPState.{name} is internal"):
            value = getattr(state, name)
        assert value is getattr(state, "_" + name)
