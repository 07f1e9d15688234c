"""``commpress.fsdp``: the FSDP2 hook, :mod:`commpress.hooks.fsdp` under a short name.

Importing it (``import commpress.fsdp``, or the first ``commpress.fsdp`` attribute access)
imports FSDP2; ``import commpress`` alone does not.  This module replaces itself with
:mod:`commpress.hooks.fsdp` in ``sys.modules``: both names are the same module object.
"""

import sys

from .hooks import fsdp as _fsdp

sys.modules[__name__] = _fsdp
