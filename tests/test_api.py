"""The public names later code and users import, with the parameters they pass."""

import inspect

import torch


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_hook_modules_import_by_their_public_names():
    import commpress.ddp
    import commpress.fsdp

    assert {"register", "DDPState", "hook", "HookError", "ReplicaMismatchError"} <= set(commpress.ddp.__all__)
    assert {"register", "FSDPState"} <= set(commpress.fsdp.__all__)
    for module in (commpress.ddp, commpress.fsdp):
        assert all(callable(getattr(module, name)) for name in module.__all__ if not name.isupper())
    assert {"model", "compressor", "error_feedback", "warmup_steps", "algorithm", "overlap", "hierarchy",
            "compressor_params"} <= _params(commpress.ddp.register)
    assert {"module", "compressor", "error_feedback", "all_gather", "replicate_group"} <= _params(
        commpress.fsdp.register)


def test_import_commpress_leaves_fsdp2_out_until_commpress_fsdp_is_used():
    """FSDP2's modules take seconds to import: a DDP rank process does not pay them."""
    import subprocess
    import sys

    code = ("import sys, commpress; assert 'torch.distributed.fsdp' not in sys.modules; "
            "f = commpress.fsdp; import commpress.fsdp as g; import commpress.hooks.fsdp as h; "
            "from commpress.fsdp import register; "
            "assert f is g is h is commpress.hooks.fsdp and register is h.register; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_collectives_public_functions():
    from commpress import collectives

    for name in ("allreduce", "reduce_scatter", "all_gather"):
        fn = getattr(collectives, name)
        assert name in collectives.__all__
        assert {"tensor", "compressor", "group", "key", "step", "stats"} <= _params(fn), name
    assert {"out"} <= _params(collectives.all_gather) and {"transaction", "out"} <= _params(collectives.allreduce)


def test_error_feedback_keeps_its_constructor_and_protocol():
    import commpress

    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.25), beta=1.0, momentum=0.5)
    x = torch.arange(8, dtype=torch.float32)
    sent = ef.decompress(ef.compress(x, key="k"))
    state = ef.state_dict()
    assert set(state) == {"beta", "residuals", "compressor", "momentum", "velocities"}
    # what was not sent is remembered: sent + residual == the compensated input (u = x at the first step)
    torch.testing.assert_close(sent + ef.residual("k"), x, rtol=0, atol=0)
    for method in ("compensate", "stage", "commit", "rollback"):
        assert callable(getattr(ef, method)), method


def test_ddp_register_takes_typed_options_and_only_compressor_parameters_in_its_bag():
    import commpress.ddp

    sig = inspect.signature(commpress.ddp.register)
    for name in ("join_buckets", "momentum", "momentum_masking", "auto", "residual_storage", "rollback",
                 "scaler", "optimizer", "sparse_rows"):
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert sig.parameters[name].annotation != inspect.Parameter.empty, name
    assert list(sig.parameters)[:2] == ["model", "compressor"]
    assert _params(commpress.ddp.DDPState) >= {"join_buckets", "momentum", "momentum_masking", "auto", "sparse_rows"}


def test_auto_options_are_typed_and_the_keyword_spelling_warns():
    import warnings

    import pytest

    from commpress.auto.runtime import AutoSpec
    from commpress.ddp import DDPState

    with warnings.catch_warnings():
        warnings.simplefilter("error")      # the typed spellings never warn
        typed = DDPState("auto", auto=AutoSpec(candidates=[("topk", 0.01)], check_every=5), min_numel=64)
        DDPState("topk", ratio=0.01, momentum=0.9, momentum_masking=True, join_buckets=True).close()
    with pytest.warns(DeprecationWarning, match=r"auto=commpress\.auto\.runtime\.AutoSpec\(candidates=\.\.\., "
                                                r"check_every=\.\.\.\)"):
        old = DDPState("auto", candidates=[("topk", 0.01)], check_every=5, min_numel=64)
    assert old.config() == typed.config()           # the same fingerprint: ranks may mix the spellings
    with pytest.raises(ValueError, match="given twice"):
        DDPState("auto", auto=AutoSpec(), check_every=5)
    with pytest.raises(ValueError, match="auto= .*only with it.*'topk'"):
        DDPState("topk", ratio=0.01, auto=AutoSpec())
    with pytest.raises(TypeError, match="auto must be a commpress.auto.runtime.AutoSpec"):
        DDPState("auto", auto={"check_every": 5})
    with pytest.raises(ValueError, match="ratio"):
        DDPState("auto", auto=AutoSpec(), ratio=0.01)
    with pytest.raises(ValueError, match="check_every"):
        AutoSpec(check_every=0)                      # validated in one place, when built
    for s in (typed, old):
        s.close()


def test_ddp_state_momentum_is_a_typed_keyword():
    from commpress.ddp import DDPState

    state = DDPState("topk", ratio=0.01, momentum=0.9)
    assert state.config()["momentum"] == 0.9 and state.config()["momentum_masking"] is False
    assert DDPState("topk", ratio=0.01, momentum=0.9, momentum_masking=True).config()["momentum"] == 0.9
    state.close()


def test_ddp_state_internals_are_private_and_their_old_names_warn():
    import pytest

    from commpress.ddp import DDPState

    state = DDPState("topk", ratio=0.01, hierarchy=None)
    for name in ("executor", "layout", "lowrank", "hierarchy_arg"):
        with pytest.warns(DeprecationWarning, match=rf"DDPState\.{name} is internal"):
            assert getattr(state, name) is getattr(state, "_" + name)
    for name in ("bind", "stats", "state_dict", "load_state_dict", "close", "attach_optimizer", "attach_scaler",
                 "config", "step", "last_error", "bound"):
        assert hasattr(state, name), name
    state.close()
