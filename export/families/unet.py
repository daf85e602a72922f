"""What the U-Net families (export/families/sd15.py, sdxl.py) share: a UNet2DConditionModel with
cross-attention and skip connections, and the 4-channel VAE, as data.

The UNet halves the latent at every down block but the last, so latent sides are multiples of
2 ** (down blocks - 1): the pipeline's `latent_multiple`.

The UNet takes a ControlNet's residuals as inputs (`down_residual_0`... and `mid_residual`, added
after each down-block layer and to the mid block's output): zeros when no ControlNet runs, so one
graph serves both paths and a ControlNet added later needs no new UNet (export/families/controlnet.py).
A UNet of another layout than its family's real ones exports without them (and takes no ControlNet).

Every UNet is exported beside its shallow branch (`unet_shallow`), which DeepCache runs on its cached
steps (export/families/deep_cache.py).
"""
from __future__ import annotations

import dataclasses

import torch

from export.families.deep_cache import unet_specs
from export.families.parts import clip_constants, clip_tokenizers, vae_runtime_constants
from export.spec import SubmoduleSpec, TensorSpec as T

_LATENT = ("batch", "in_channels", "latent_height", "latent_width")
# Everything outside the down, mid and up blocks: quantization keeps it in float (its errors
# reach every block, or the output directly).
_KEEP_SCOPES = ("conv_in", "time_proj", "time_embedding", "add_time_proj", "add_embedding", "conv_norm_out", "conv_out")


# The layouts of the real UNets of each family: (down blocks, resnets per block). ControlNet residual
# inputs are declared for these.
LAYOUTS = {"sd15": (4, 2), "sdxl": (3, 2)}


def residual_specs(blocks: int, layers: int) -> tuple[T, ...]:
    """A ControlNet's residuals for a UNet of `blocks` down blocks of `layers` resnets, in diffusers'
    order: conv_in's output, each resnet's and each downsampler's (all blocks but the last), then the
    mid block's. Block b works at 1/2**b of the latent size, with its own width (unet_block_b)."""

    def at(block: int, scale: int) -> tuple:
        sides = ("latent_height", "latent_width") if scale == 1 else (f"latent_height_{scale}", f"latent_width_{scale}")
        return ("batch", f"unet_block_{block}", *sides)

    shapes = [at(0, 1)]
    for b in range(blocks):
        shapes += [at(b, 2 ** b)] * layers
        if b < blocks - 1:
            shapes.append(at(b, 2 ** (b + 1)))
    return tuple(T(f"down_residual_{i}", "float32", s) for i, s in enumerate(shapes)) + (
        T("mid_residual", "float32", at(blocks - 1, 2 ** (blocks - 1))),)


def residual_dims(blocks: int) -> dict:
    """latent_height_S, latent_width_S: the latent sides at 1/S, S = 2 .. 2**(blocks-1)."""
    return {f"latent_{axis}_{2 ** b}": (lambda base, axis=axis, s=2 ** b: base[f"latent_{axis}"] // s)
            for b in range(1, blocks) for axis in ("height", "width")}


def split_residuals(inputs) -> tuple[list, object]:
    """(down residuals, mid residual) of a wrapper's trailing inputs."""
    return list(inputs[:-1]), inputs[-1]


class UNet(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, *residuals):
        return (self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False,
                          **_residual_kwargs(residuals))[0],)


class UNetXL(UNet):
    """SDXL's added conditions, CLIP-G's pooled embedding and the six size conditions, as two more inputs."""

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids, *residuals):
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return (self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added,
                          return_dict=False, **_residual_kwargs(residuals))[0],)


def _residual_kwargs(residuals) -> dict:
    if not residuals:
        return {}
    down, mid = split_residuals(residuals)
    return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}


def has_layout(src, family: str) -> bool:
    """Whether the source's UNet has its family's real layout (the one ControlNet residuals are declared for)."""
    unet = src.config("unet")
    return (len(unet["block_out_channels"]), unet["layers_per_block"]) == LAYOUTS[family]


def unet_specs_of(family: str, wrap, *added: T) -> tuple[SubmoduleSpec, ...]:
    """The UNet with ControlNet residual inputs (its family's layout), and without (any other), each beside
    its shallow branch's graph (DeepCache's, export/families/deep_cache.py)."""
    inputs = (
        T("sample", "float32", _LATENT),
        T("timestep", "float32", ("batch",), high="num_train_timesteps"),
        T("encoder_hidden_states", "float32", ("batch", "clip_length", "cross_dim")),
        *added,
    )
    plain = SubmoduleSpec(
        name="unet",
        component="unet",
        inputs=inputs,
        outputs=(T("noise_pred", "float32", ("batch", "out_channels", "latent_height", "latent_width")),),
        wrap=wrap,
        quantization={"denoiser": True, "keep_scopes": _KEEP_SCOPES},
        when=lambda src: not has_layout(src, family),
        latent_divisor="latent_multiple",  # its down-sampling
    )
    with_residuals = dataclasses.replace(plain, inputs=inputs + residual_specs(*LAYOUTS[family]),
                                         when=lambda src: has_layout(src, family))
    names = tuple(t.name for t in added)
    return (*unet_specs(with_residuals, names), *unet_specs(plain, names))


SDXL_ADDED = (T("text_embeds", "float32", ("batch", "clip2_proj")), T("time_ids", "float32", ("batch", "time_ids")))


def constants(src) -> dict[str, int]:
    unet, vae = src.config("unet"), src.config("vae")
    c = {
        "clip_length": src.tokenizer_max_length("tokenizer"),
        **clip_constants(src.config("text_encoder"), "clip"),
        "cross_dim": unet["cross_attention_dim"],
        "in_channels": unet["in_channels"],
        "out_channels": unet["out_channels"],
        "latent_channels": vae["latent_channels"],
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
        "latent_multiple": 2 ** (len(unet["block_out_channels"]) - 1),
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
        **{f"unet_block_{b}": width for b, width in enumerate(unet["block_out_channels"])},
    }
    if src.has("text_encoder_2"):
        c.update(clip_constants(src.config("text_encoder_2"), "clip2"))
        # Six size conditions, or five where the UNet was trained with an aesthetic score in place of
        # the target size (requires_aesthetics_score: SDXL's refiner); the UNet's widths say which.
        c["time_ids"] = (unet["projection_class_embeddings_input_dim"] - c["clip2_proj"]) // unet[
            "addition_time_embed_dim"]
    return c


def runtime_constants(src) -> dict:
    c = constants(src)
    return {
        **vae_runtime_constants(src.config("vae")),
        "denoiser": "unet",
        "latent_multiple": c["latent_multiple"],
        "clip_length": c["clip_length"],
        # SDXL: without a negative prompt, guidance's unconditional half is zeros
        "force_zeros_for_empty_prompt": bool(src.model_index().get("force_zeros_for_empty_prompt", False)),
    }


def build_pipeline(pipeline_class: str, encoders: dict[str, str], pads: dict[str, str], configs: dict, out_dir,
           seed: int, **pipeline_kwargs) -> None:
    """Write a pipeline folder with random seeded weights: `encoders` maps each text encoder
    component to its transformers class; `pads` each tokenizer to its pad token. The configs may
    name another pipeline class of the family ("pipeline_class": an inpainting one) and its
    arguments ("pipeline_kwargs")."""
    import tempfile

    import diffusers
    import transformers

    from export.random_weights import build_modules, save_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        builders = {"unet": lambda: diffusers.UNet2DConditionModel(**configs["unet"]),
                    "vae": lambda: diffusers.AutoencoderKL(**configs["vae"])}
        for name, cls in encoders.items():
            builders[name] = lambda name=name, cls=cls: getattr(transformers, cls)(
                transformers.CLIPTextConfig(**configs[name]))
        scheduler = configs["scheduler"]
        # from_config, as from_pretrained does: the real configs carry keys a class ignores
        others = {"scheduler": getattr(diffusers, scheduler["_class_name"]).from_config(scheduler),
                  **clip_tokenizers(tmp, pads), **pipeline_kwargs, **configs.get("pipeline_kwargs", {})}
        save_pipeline(configs.get("pipeline_class", pipeline_class), build_modules(builders, seed, streamed=False),
                      others, out_dir)
