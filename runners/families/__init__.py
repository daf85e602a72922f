"""The model families the runner knows, one package each (`runners/families/<name>/`), named as the
export's families are (`export/families/`). Importing this package imports every family in it, and
each registers itself with `Pipeline.load` by defining its pipeline class (its `family` name) and its
tables (preview factors, LoRA key spellings) as class attributes or through the registries it calls:
adding a family is adding its package, with no edit here or to a shared module."""
from __future__ import annotations

import importlib
import pkgutil

NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg))
for _name in NAMES:
    importlib.import_module(f"{__name__}.{_name}")
