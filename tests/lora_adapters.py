"""Test LoRA adapters: made with peft on a tiny pipeline's own modules (random adapter weights),
saved by diffusers' save functions, and converted to kohya's format by a script of the tests'
own (not our reader's code), so that the reader is checked against independent files."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# The modules each adapter changes, by component (peft's target_modules: name suffixes).
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
CLIP_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]


def make_adapter(pipeline_cls, folder, out: Path, targets: dict[str, list[str]], seed: int, rank: int = 4,
                 alpha: float = 8.0) -> Path:
    """An adapter for `targets` ({component: target modules}) of the tiny pipeline in `folder`,
    saved with `pipeline_cls.save_lora_weights` (diffusers/PEFT format, with its adapter metadata)."""
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    torch.manual_seed(seed)
    pipe = pipeline_cls.from_pretrained(folder)
    layers, metadata = {}, {}
    for component, modules in targets.items():
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, init_lora_weights=False)
        getattr(pipe, component).add_adapter(config)
        # peft's random init is on the scale of the weights: a visible but not overwhelming change
        for name, p in getattr(pipe, component).named_parameters():
            if "lora_" in name:
                p.data = 0.3 * torch.randn_like(p)
        layers[f"{component}_lora_layers"] = get_peft_model_state_dict(getattr(pipe, component))
        metadata[f"{component}_lora_adapter_metadata"] = config.to_dict()
    pipeline_cls.save_lora_weights(out, **layers, **metadata)
    return Path(out) / "pytorch_lora_weights.safetensors"


def read_raw(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    data = Path(path).read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    metadata = header.pop("__metadata__", {})
    return {k: np.frombuffer(data[8 + size + v["data_offsets"][0]:8 + size + v["data_offsets"][1]],
                             np.float32).reshape(v["shape"]) for k, v in header.items()}, metadata


def write_raw(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> Path:
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(path), metadata=metadata)
    return Path(path)


def to_kohya(peft_file: Path, out: Path, prefixes: dict[str, str]) -> Path:
    """kohya's format of a diffusers-saved adapter: `lora_unet_<module with _>.lora_down.weight`,
    `.lora_up.weight` and `.alpha`, with `prefixes` naming each component (unet -> lora_unet). The
    text encoders' modules are under `text_model`, as in the checkpoints kohya's scripts train on."""
    tensors, metadata = read_raw(peft_file)
    config = json.loads(metadata["lora_adapter_metadata"])
    out_tensors = {}
    for key, value in tensors.items():
        component, rest = key.split(".", 1)
        module, role = rest.rsplit(".", 2)[0], rest.rsplit(".", 2)[1]
        if component.startswith("text_encoder") and not module.startswith("text_model."):
            module = f"text_model.{module}"
        name = prefixes[component] + module.replace(".", "_")
        out_tensors[f"{name}.{'lora_down' if role == 'lora_A' else 'lora_up'}.weight"] = value
        out_tensors[f"{name}.alpha"] = np.array(config[f"{component}.lora_alpha"], np.float32)
    return write_raw(out, out_tensors)


def with_peft_naming(peft_file: Path, out: Path) -> Path:
    """The same adapter with PEFT's in-model names: `<module>.base_layer` segments and the adapter
    name (`lora_A.default.weight`), and its alpha as per-module tensors instead of metadata."""
    tensors, metadata = read_raw(peft_file)
    config = json.loads(metadata["lora_adapter_metadata"])
    renamed = {}
    for key, value in tensors.items():
        component = key.split(".", 1)[0]
        module, role = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        renamed[f"{module}.base_layer.{role}.default.weight"] = value
        renamed[f"{module}.alpha"] = np.array(config[f"{component}.lora_alpha"], np.float32)
    return write_raw(out, renamed)
