"""Adapters in a transformer's original (Black Forest Labs) module names, as kohya's scripts save them
(`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`) and ComfyUI's and ai-toolkit's exports do
(`diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight`, or lora_A / lora_B), turned into the
diffusers module names an artifact's weights record, by a family's table ({original module: the diffusers
modules it holds}), as diffusers' converters do (diffusers/loaders/lora_conversion_utils.py).

A fused original projection (a block's qkv) may be several diffusers modules: its `up` is split along its
output rows, each part with the whole `down` (the change of each module is exactly its rows of the fused
change). A table may name modules whose `up` halves are swapped (FLUX.1's final adaLN modulation holds
(shift, scale) where diffusers' norm_out holds (scale, shift)).
"""
from __future__ import annotations

import re

import numpy as np

_KEY = re.compile(r"^(?:lora_unet_|diffusion_model\.)(?P<module>.+?)\.(?P<role>lora_down|lora_up|lora_A|lora_B|alpha)"
                  r"(?:\.weight)?$")
_ROLE = {"lora_down": "lora_A", "lora_A": "lora_A", "lora_up": "lora_B", "lora_B": "lora_B", "alpha": "alpha"}


class OriginalNames:
    """A converter of adapters' keys (`runners.adapters.lora.register_key_spelling`): `modules` maps an original
    module name, dots written as underscores and "(\\d+)" for a block index, to the diffusers modules it holds in
    its row order ("{}" for the index); `swapped` names those whose `up` halves swap."""

    def __init__(self, modules: dict[str, tuple[str, ...]], swapped: frozenset[str] = frozenset()):
        self.modules, self.swapped = modules, swapped

    def _modules(self, original: str) -> tuple[str, tuple[str, ...]] | None:
        flat = original.replace(".", "_")
        for pattern, modules in self.modules.items():
            match = re.fullmatch(pattern, flat)
            if match:
                return pattern, tuple(m.format(*match.groups()) for m in modules)
        return None

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The adapter with its original keys as diffusers' PEFT keys of the transformer
        (`transformer.<module>.lora_A.weight`, `lora_B.weight`, `alpha`); other keys as they are (an original
        name the table does not hold stays too, so that the reader reports it as unmatched)."""
        out, groups = {}, {}
        for name, array in tensors.items():
            match = _KEY.match(name)
            found = match and self._modules(match["module"])
            if not found:
                out[name] = array
                continue
            groups.setdefault(found, {})[_ROLE[match["role"]]] = array
        for (pattern, modules), roles in groups.items():
            up = roles.get("lora_B")
            if up is not None and pattern in self.swapped:
                up = np.concatenate(np.split(up, 2)[::-1])
            if up is not None and len(modules) > 1:  # q, k, v of the input's width; FLUX.1's single MLP the rest
                width = roles["lora_A"].shape[1] if "lora_A" in roles else up.shape[0] // len(modules)
                ups = np.split(up, [width * i for i in range(1, len(modules))])
            else:
                ups = [up] * len(modules)
            for module, part in zip(modules, ups):
                named = {"lora_A": roles.get("lora_A"), "lora_B": part, "alpha": roles.get("alpha")}
                out.update({f"transformer.{module}.{role}{'' if role == 'alpha' else '.weight'}": value
                            for role, value in named.items() if value is not None})
        return out
