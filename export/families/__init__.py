"""Model families by name. A family describes its submodules as data (see export/spec.py)."""
from export.families import flux, sd3, unet

FAMILIES = {family.name: family for family in (sd3.FAMILY, unet.SD15, unet.SDXL, flux.FAMILY)}
