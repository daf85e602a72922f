"""Model families by name, one module each (`export/families/<name>.py`, named as the runner's
`runners/families/<name>/`), found here by the `FAMILY` it defines: adding a family is adding its
module, with no edit here. A family describes its submodules as data (see export/spec.py); the other
modules hold what families share (parts, unet) and the graphs beside them (ControlNets, caches)."""
from __future__ import annotations

import importlib
import pkgutil

from export.spec import Family

FAMILIES: dict[str, Family] = {}
for _module in pkgutil.iter_modules(__path__):
    _family = getattr(importlib.import_module(f"{__name__}.{_module.name}"), "FAMILY", None)
    if isinstance(_family, Family):
        assert _family.name == _module.name, f"export/families/{_module.name}.py defines family {_family.name!r}"
        FAMILIES[_family.name] = _family
