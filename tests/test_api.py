"""The public names later code and users import."""

def test_hook_modules_import_by_their_public_names():
    import commpress
    import commpress.ddp
    import commpress.fsdp
    from commpress.ddp import register as ddp_register
    from commpress.fsdp import register as fsdp_register

    assert commpress.ddp.register is ddp_register and commpress.fsdp.register is fsdp_register
