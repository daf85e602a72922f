"""What DeepCache (runners/caches/deep_cache.py; Ma et al., 2023, as the DeepCache library's
`DeepCacheSDHelper` runs it at branch 0) needs from a U-Net's export, for the SD1.5 and SDXL families.

On a cached step DeepCache reuses every layer of the last full step but the shallowest: it runs the time
embedding, `conv_in` and the last layer of the last up block, which takes conv_in's output (its skip
connection) beside the hidden stream the deeper layers gave on the last full step.

- The U-Net graph gives one more output, `deep_feature`: that hidden stream (the output of the layer
  before the last one of the last up block), which a full step keeps.
- A second, small graph, `unet_shallow`, runs the shallow branch on a given `deep_feature`: the time
  embedding (with SDXL's added conditions), `conv_in` plus a ControlNet's first residual (the one added to
  conv_in's skip connection), the last up block's last resnet and attention, and the output layers.

The U-Net stays the one denoiser every build, precision, calibration and adapter handles; the small
graph holds the same parameter names (adapters and weight provenance apply to it as to the U-Net)."""
from __future__ import annotations

import dataclasses

import torch

from export.families.first_block import adopt, hooked
from export.spec import SubmoduleSpec, TensorSpec as T

NAME = "unet_shallow"
FEATURE = T("deep_feature", "float32", ("batch", "unet_block_0", "latent_height", "latent_width"))
FIRST_RESIDUAL = "down_residual_0"  # a ControlNet's residual for conv_in's output


def _last_layers(unet) -> tuple:
    """The last up block's layers, in order: (resnet, attention or None) pairs."""
    block = unet.up_blocks[-1]
    attentions = getattr(block, "attentions", None) or [None] * len(block.resnets)
    return tuple(zip(block.resnets, attentions))


class WithDeepFeature(torch.nn.Module):
    """A U-Net wrapper whose outputs gain `deep_feature`."""

    def __init__(self, wrapper):
        super().__init__()
        adopt(self, wrapper)

    def forward(self, *inputs):
        resnet, attention = _last_layers(self.wrapper.unet)[-2]
        taken = {}

        def take(layer, args, kwargs, output):
            taken["feature"] = output[0] if isinstance(output, tuple) else output

        with hooked(attention or resnet, take):
            outputs = self.wrapper(*inputs)
        return (*outputs, taken["feature"])


def _shallow_only(unet):
    """A shallow copy of `unet` holding only what the shallow branch runs (its parameters keep their names,
    "up_blocks.3.resnets.2..."; the graph does not carry the other blocks' weights)."""
    shallow = object.__new__(type(unet))
    shallow.__dict__.update(unet.__dict__)
    shallow._modules = {k: m for k, m in unet._modules.items() if k not in ("down_blocks", "mid_block", "up_blocks")}
    last = len(unet.up_blocks) - 1
    block = torch.nn.Module()
    resnet, attention = _last_layers(unet)[-1]
    block.resnets = torch.nn.Module()
    block.resnets._modules[str(len(unet.up_blocks[-1].resnets) - 1)] = resnet
    if attention is not None:
        block.attentions = torch.nn.Module()
        block.attentions._modules[str(len(unet.up_blocks[-1].attentions) - 1)] = attention
    shallow._modules["up_blocks"] = torch.nn.Module()
    shallow._modules["up_blocks"]._modules[str(last)] = block
    shallow.__dict__["shallow_layer"] = (resnet, attention)  # not children: registered above under their names
    return shallow


class Shallow(torch.nn.Module):
    """The shallow branch: inputs the U-Net's (with `added` SDXL conditions after the text embeddings), then
    `deep_feature`, then conv_in's ControlNet residual where the U-Net takes residuals; output the prediction."""

    def __init__(self, wrap, unet, added: tuple[str, ...], residual: bool):
        super().__init__()
        adopt(self, wrap(_shallow_only(unet)))
        self.added, self.residual = added, residual

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        unet = self.wrapper.unet
        conditions = dict(zip(self.added, rest))
        feature, *residual = rest[len(self.added):]
        # UNet2DConditionModel.forward's embedding and input layer, for the families' configs (no class
        # embedding, no encoder projection)
        emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), None)
        aug = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=conditions)
        emb = emb + aug if aug is not None else emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        skip = unet.conv_in(sample)
        if residual:
            skip = skip + residual[0]
        resnet, attention = unet.shallow_layer
        hidden = resnet(torch.cat([feature, skip], dim=1), emb)
        if attention is not None:
            hidden = attention(hidden, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]
        if unet.conv_norm_out:
            hidden = unet.conv_act(unet.conv_norm_out(hidden))
        return (unet.conv_out(hidden),)


def unet_specs(spec: SubmoduleSpec, added: tuple[str, ...] = ()) -> tuple[SubmoduleSpec, SubmoduleSpec]:
    """The family's U-Net description with `deep_feature`, and its shallow graph's (module docstring).
    `added`: the names of the inputs the U-Net takes after the text embeddings (SDXL's conditions)."""
    residual = [t for t in spec.inputs if t.name == FIRST_RESIDUAL]
    plain = [t for t in spec.inputs if "_residual" not in t.name]
    full = dataclasses.replace(spec, outputs=(*spec.outputs, FEATURE),
                               wrap=lambda component: WithDeepFeature(spec.wrap(component)))
    shallow = dataclasses.replace(spec, name=NAME, inputs=(*plain, FEATURE, *residual), latent_divisor=1,
                                  wrap=lambda component: Shallow(spec.wrap, component, added, bool(residual)))
    return full, shallow
