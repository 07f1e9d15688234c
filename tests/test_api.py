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
