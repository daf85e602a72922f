"""ControlNet against diffusers' StableDiffusion(XL)ControlNet pipelines and their Img2Img and Inpaint
twins: the same weights (random tiny ControlNets whose zero output convolutions got random weights),
the same latents and noise, fp32; images within 1/255. Every case also proves the ControlNet was used:
diffusers' image with it differs from its image at scale 0 (the same as without it)."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

import diffusers.models.autoencoders.vae as diffusers_vae
from conftest import (
    assert_calls_keep_apart, assert_real_image, assert_served_image, compare_controlled, controlnet_folder, edge_image,
    library_deep_cache, manifest, rtx_options, smooth_image, soft_mask, with_controlnets,
)
from runners import DeepCacheConfig, Pipeline
from runners.conditioning.controlnet import residual_inputs

ONE_LEVEL = 1 / 255
STEPS = 5


@pytest.fixture(scope="module")
def sd15_one(shared_root, sd15_tiny_build):
    return with_controlnets(shared_root, sd15_tiny_build, ["sd15-controlnet-tiny"], "sd15-cn")


@pytest.fixture(scope="module")
def sd15_two(shared_root, sd15_tiny_build, sd15_one):
    return with_controlnets(shared_root, sd15_tiny_build, ["sd15-controlnet-tiny", "sd15-controlnet-tiny-2"],
                            "sd15-cn2")


@pytest.fixture(scope="module")
def sd3_one(shared_root, sd3_tiny_build):
    return with_controlnets(shared_root, sd3_tiny_build, ["sd3-controlnet-tiny"], "sd3-cn")


@pytest.fixture(scope="module")
def sd3_inpaint(shared_root, sd3_tiny_build, sd3_one):
    return with_controlnets(shared_root, sd3_tiny_build, ["sd3-controlnet-inpaint-tiny"], "sd3-cn-inpaint")


@pytest.fixture(scope="module")
def sd3_large(shared_root, sd3_tiny_build, sd3_one):
    return with_controlnets(shared_root, sd3_tiny_build, ["sd3-controlnet-large-tiny"], "sd3-cn-large")


@pytest.fixture(scope="module")
def flux_one(shared_root, flux_tiny_build):
    return with_controlnets(shared_root, flux_tiny_build, ["flux-controlnet-tiny"], "flux-cn")


@pytest.fixture(scope="module")
def flux_union(shared_root, flux_tiny_build, flux_one):
    return with_controlnets(shared_root, flux_tiny_build, ["flux-controlnet-union-tiny"], "flux-cn-union")


@pytest.fixture(scope="module")
def flux_xlabs(shared_root, flux_tiny_build, flux_one):
    return with_controlnets(shared_root, flux_tiny_build, ["flux-controlnet-xlabs-tiny"], "flux-cn-xlabs")


@pytest.fixture(scope="module")
def sdxl_one(shared_root, sdxl_tiny_build):
    return with_controlnets(shared_root, sdxl_tiny_build, ["sdxl-controlnet-tiny"], "sdxl-cn")


def _reference(pipeline_class: str, build, controlnets: list[str]):
    import inspect
    import json

    import diffusers

    folders = [controlnet_folder(n) for n in controlnets]
    nets = [getattr(diffusers, json.loads((f / "config.json").read_text())["_class_name"]).from_pretrained(f)
            for f in folders]
    base = diffusers.DiffusionPipeline.from_pretrained(build.source.folder)
    cls = getattr(diffusers, pipeline_class)
    taken = inspect.signature(cls).parameters  # FluxPipeline's IP-Adapter components: not its ControlNet twins'
    components = {k: v for k, v in base.components.items() if k in taken}
    pipe = cls(**components, controlnet=nets[0] if len(nets) == 1 else nets)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(height: int, width: int, seed: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, height // 8, width // 8), dtype=np.float32)


TEXT_CASES = {  # (build fixture, ControlNets, pipeline): the call's arguments
    "sd15_one": dict(height=64, width=64),
    "sd15_window_non_square": dict(height=64, width=128, control_guidance_start=0.2, control_guidance_end=0.8),
    "sd15_guess_mode": dict(height=64, width=64, guess_mode=True, controlnet_conditioning_scale=0.8),
    "sd15_two_scales": dict(height=64, width=64, controlnet_conditioning_scale=[0.9, 0.5]),
    "sdxl_one": dict(height=64, width=64),
}
_SETUPS = {"sd15_one": ("sd15_one", "sd15_tiny_build", ["sd15-controlnet-tiny"], "StableDiffusionControlNetPipeline"),
           "sd15_two": ("sd15_two", "sd15_tiny_build", ["sd15-controlnet-tiny", "sd15-controlnet-tiny-2"],
                        "StableDiffusionControlNetPipeline"),
           "sdxl_one": ("sdxl_one", "sdxl_tiny_build", ["sdxl-controlnet-tiny"], "StableDiffusionXLControlNetPipeline"),
           "sd3_one": ("sd3_one", "sd3_tiny_build", ["sd3-controlnet-tiny"], "StableDiffusion3ControlNetPipeline"),
           "sd3_large": ("sd3_large", "sd3_tiny_build", ["sd3-controlnet-large-tiny"],
                         "StableDiffusion3ControlNetPipeline"),
           "sd3_inpaint": ("sd3_inpaint", "sd3_tiny_build", ["sd3-controlnet-inpaint-tiny"],
                           "StableDiffusion3ControlNetInpaintingPipeline"),
           "flux_one": ("flux_one", "flux_tiny_build", ["flux-controlnet-tiny"], "FluxControlNetPipeline"),
           "flux_union": ("flux_union", "flux_tiny_build", ["flux-controlnet-union-tiny"], "FluxControlNetPipeline"),
           "flux_xlabs": ("flux_xlabs", "flux_tiny_build", ["flux-controlnet-xlabs-tiny"], "FluxControlNetPipeline")}


@pytest.fixture(scope="module")
def loaded(request):
    """{setup: (our pipeline, diffusers' pipeline)}, loaded once per setup."""
    cache = {}

    def get(setup):
        if setup not in cache:
            artifact, build, nets, cls = _SETUPS[setup]
            cache[setup] = (Pipeline.load(request.getfixturevalue(artifact) / "ort-fp32"),
                            _reference(cls, request.getfixturevalue(build), nets))
        return cache[setup]

    return get


@pytest.mark.parametrize("case", TEXT_CASES)
def test_text_to_image_matches_diffusers(loaded, case):
    setup = "sd15_two" if case == "sd15_two_scales" else "sdxl_one" if case.startswith("sdxl") else "sd15_one"
    pipe, reference = loaded(setup)
    kwargs = dict(TEXT_CASES[case], prompt="a photo of a cat", num_inference_steps=STEPS)
    height, width = kwargs["height"], kwargs["width"]
    count = len(pipe.controlnets())
    control = [edge_image(height, width, seed=k) for k in range(count)]
    control = control if count > 1 else control[0]
    latents = _latents(height, width, seed=len(case))
    ours = pipe(latents=latents, output_type="np", control_image=control, **kwargs)
    ref = reference(image=control, latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    unused = reference(image=control, latents=torch.from_numpy(latents), output_type="np",
                       **{**kwargs, "controlnet_conditioning_scale": 0.0}).images
    compare_controlled(ours, ref, unused)


TRANSFORMER_CASES = {  # (setup: the call's arguments)
    "sd3_one": dict(height=64, width=64),
    "sd3_window_scale_non_square": dict(height=64, width=96, controlnet_conditioning_scale=0.7,
                                        control_guidance_start=0.2, control_guidance_end=0.8),
    "sd3_large": dict(height=64, width=96),  # SD3.5 Large's kind: the transformer's patch embedding, no text
    "flux_one": dict(height=64, width=64),
    "flux_window_scale_non_square": dict(height=64, width=96, controlnet_conditioning_scale=0.7,
                                         control_guidance_start=0.2, control_guidance_end=0.8),
    "flux_true_cfg": dict(height=64, width=64, negative_prompt="blurry", true_cfg_scale=2.0),
    "flux_union": dict(height=64, width=64, control_mode=2),  # a ControlNet-Union: its mode is one more token
    "flux_xlabs": dict(height=64, width=96),  # XLabs' kind: the image in pixels, its residuals repeated
}


@pytest.mark.parametrize("case", TRANSFORMER_CASES)
def test_transformer_controlnets_match_diffusers(monkeypatch, loaded, case):
    """StableDiffusion3ControlNetPipeline (with SD3.5 Large's kind of ControlNet too, to which it gives the
    transformer's patch embedding) and FluxControlNetPipeline. The control image's VAE sample takes our
    `control_noise`: SD3's one per half of the guided batch (diffusers encodes the doubled image), Flux's one
    per image (its ControlNet runs once, on the prompt's conditions, also under true CFG)."""
    family = case.split("_")[0]
    pipe, reference = loaded(case if case in _SETUPS else f"{family}_one")
    kwargs = dict(TRANSFORMER_CASES[case], prompt="a photo of a cat", num_inference_steps=STEPS, output_type="np")
    if family == "flux":
        kwargs["max_sequence_length"] = 32
    height, width = kwargs["height"], kwargs["width"]
    rng = np.random.default_rng(len(case))
    latents = rng.standard_normal((1, 16, height // 8, width // 8), dtype=np.float32)
    latents = pipe.layout.as_diffusers(latents)
    control_noise = rng.standard_normal((2 if family == "sd3" else 1, 16, height // 8, width // 8), dtype=np.float32)
    monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(control_noise))
    control = edge_image(height, width, seed=2)
    ours = pipe(latents=latents, control_image=control, control_noise=control_noise, **kwargs)
    ref = reference(control_image=control, latents=torch.from_numpy(latents), **kwargs).images
    unused = reference(control_image=control, latents=torch.from_numpy(latents),
                       **{**kwargs, "controlnet_conditioning_scale": 0.0}).images
    compare_controlled(ours, ref, unused)


@pytest.mark.parametrize("case", ["flux_image_to_image", "flux_inpainting"])
def test_flux_controlnet_image_tasks_match_diffusers(monkeypatch, loaded, flux_tiny_build, case):
    """FluxControlNetImg2ImgPipeline and FluxControlNetInpaintPipeline (the known part blended back). diffusers
    samples the VAE posteriors in this order: the control image's (`control_noise`), the image's
    (`encoder_noise`), the masked image's (inpainting; its blending loop never reads it); then the noise."""
    import importlib

    cls, module = {"flux_image_to_image": ("FluxControlNetImg2ImgPipeline", "image_to_image"),
                   "flux_inpainting": ("FluxControlNetInpaintPipeline", "inpainting")}[case]
    module = importlib.import_module(f"diffusers.pipelines.flux.pipeline_flux_controlnet_{module}")
    pipe, _ = loaded("flux_one")
    reference = _reference(cls, flux_tiny_build, ["flux-controlnet-tiny"])
    height, width = 64, 96
    rng = np.random.default_rng(len(case))
    control_noise, encoder_noise, noise = (rng.standard_normal((1, 16, height // 8, width // 8), dtype=np.float32)
                                           for _ in range(3))
    kwargs = dict(prompt="a photo of a cat", image=smooth_image(height, width, seed=1), height=height, width=width,
                  num_inference_steps=STEPS, strength=0.7, max_sequence_length=32, output_type="np",
                  **({"mask_image": soft_mask(height, width)} if case == "flux_inpainting" else {}))
    control = edge_image(height, width, seed=4)

    def reference_image(scale):
        draws = iter([control_noise, encoder_noise, encoder_noise])
        monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(next(draws)))
        monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: torch.from_numpy(noise))
        return reference(control_image=control, controlnet_conditioning_scale=scale, **kwargs).images

    ours = pipe(control_image=control, control_noise=control_noise, encoder_noise=encoder_noise, noise=noise,
                **kwargs)
    compare_controlled(ours, reference_image(1.0), reference_image(0.0))


def test_sd3_inpainting_controlnet_matches_diffusers(monkeypatch, loaded):
    """StableDiffusion3ControlNetInpaintingPipeline: our mask_image= is its control_mask; the masked image's
    VAE sample takes `control_noise` (one per image: diffusers encodes before it doubles the batch). A
    ControlNet that ignored the mask or the image would fail the comparison; the same call at scale 0 proves
    the ControlNet changed the image."""
    pipe, reference = loaded("sd3_inpaint")
    height, width = 64, 96
    rng = np.random.default_rng(5)
    latents = rng.standard_normal((1, 16, height // 8, width // 8), dtype=np.float32)
    control_noise = rng.standard_normal((1, 16, height // 8, width // 8), dtype=np.float32)
    monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(control_noise))
    image, mask = smooth_image(height, width, seed=3), soft_mask(height, width)
    kwargs = dict(prompt="a photo of a cat", height=height, width=width, num_inference_steps=STEPS, output_type="np")
    ours = pipe(latents=latents, control_image=image, mask_image=mask, control_noise=control_noise, **kwargs)
    ref = reference(control_image=image, control_mask=mask, latents=torch.from_numpy(latents), **kwargs).images
    unused = reference(control_image=image, control_mask=mask, latents=torch.from_numpy(latents),
                       controlnet_conditioning_scale=0.0, **kwargs).images
    compare_controlled(ours, ref, unused)
    with pytest.raises(ValueError, match="this artifact's ControlNets inpaint .*pass the image to repaint as "
                                         "control_image= and its mask as mask_image="):
        pipe("a cat", control_image=image, height=height, width=width, num_inference_steps=2)
    with pytest.raises(ValueError, match="without image="):
        pipe("a cat", image=image, control_image=image, mask_image=mask, height=height, width=width,
             num_inference_steps=2)


@pytest.mark.parametrize("setup", ["flux_union"])  # named for the flux tests' worker (conftest's groups)
def test_flux_union_modes_and_refusals(monkeypatch, loaded, request, setup):
    """A ControlNet-Union's control mode reaches its engine: ours in mode 3 is far closer to diffusers' in mode 3
    than diffusers' modes 3 and 0 are to each other (a mode embedded as one text token among many changes the
    tiny model's image by less than the 1/255 of the parity case). A Union needs a mode, within its modes, and
    other ControlNets or artifacts take none."""
    pipe, reference = loaded(setup)
    rng = np.random.default_rng(3)
    latents = pipe.layout.as_diffusers(rng.standard_normal((1, 16, 8, 8), dtype=np.float32))
    control_noise = rng.standard_normal((1, 16, 8, 8), dtype=np.float32)
    monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(control_noise))
    args = dict(prompt="a cat", height=64, width=64, num_inference_steps=STEPS, output_type="np",
                control_image=edge_image(64, 64, seed=1), max_sequence_length=32)
    ours = pipe(**args, latents=latents, control_noise=control_noise, control_mode=3)
    ref = {mode: reference(**args, latents=torch.from_numpy(latents), control_mode=mode).images for mode in (3, 0)}
    err, modes = np.abs(ours - ref[3]).max(), np.abs(ref[3] - ref[0]).max()
    print(f"mode 3 against diffusers {err:.1e}; diffusers' modes 3 and 0 differ by {modes:.1e}")
    assert modes > 1e-4 and err < modes / 10, (err, modes)
    args.update(num_inference_steps=2, latents=latents)
    with pytest.raises(ValueError, match=r"controlnet: ControlNet-Union, which needs control_mode= .*0 to 3"):
        pipe(**args)
    with pytest.raises(ValueError, match="control_mode=4 for controlnet: use an integer from 0 to 3"):
        pipe(**args, control_mode=4)
    plain, _ = loaded("flux_one")
    with pytest.raises(ValueError, match="control_mode: controlnet is not a ControlNet-Union"):
        plain(**args, control_mode=1)
    with pytest.raises(ValueError, match="control_mode= is the kind of each control image .*pass control_image="):
        pipe(**{**args, "control_image": None}, control_mode=1)
    base = Pipeline.load(request.getfixturevalue("flux_tiny_build").folder / "ort-fp32")
    with pytest.raises(ValueError, match="control_mode= is a ControlNet-Union's setting: this artifact has no"):
        base(**{**args, "control_image": None}, control_mode=1)


def test_sd3_blocks_take_diffusers_residuals():
    """The transformer's per-block residual inputs, fed by the runner's interval rule from a ControlNet of k
    blocks, give what diffusers' transformer gives from the k residuals (5 blocks, k = 2: blocks 0-2 take
    the first, block 3 the second, the last none)."""
    from diffusers import SD3Transformer2DModel

    from export.families.sd3 import _TransformerForSD3
    from runners.families.sd3.controlnet import SD3ControlNets

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=8, num_layers=5, attention_head_dim=8, num_attention_heads=2,
                                        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
                                        pos_embed_max_size=16).eval()
    inputs = (torch.randn(1, 16, 8, 8), torch.randn(1, 5, 16), torch.randn(1, 8), torch.tensor([500.0]))
    out = {f"controlnet_block_{j}": torch.randn(1, 16, 16).numpy() for j in range(2)}
    runner = object.__new__(SD3ControlNets)
    runner.manifest = {"constants": {"transformer_layers": 5},
                       "submodules": {"controlnet": {"outputs": [{"name": n} for n in out]}}}
    feeds = runner._residual_feeds("controlnet", out, [{"name": f"block_residual_{i}"} for i in range(4)])
    with torch.no_grad():
        ours = _TransformerForSD3(transformer)(*inputs, *map(torch.from_numpy, feeds))[0]
        theirs = transformer(*inputs[:1], encoder_hidden_states=inputs[1], pooled_projections=inputs[2],
                             timestep=inputs[3], block_controlnet_hidden_states=[torch.from_numpy(v) for v in out.values()],
                             return_dict=False)[0]
        plain = transformer(*inputs[:1], encoder_hidden_states=inputs[1], pooled_projections=inputs[2],
                            timestep=inputs[3], return_dict=False)[0]
    assert [f is out["controlnet_block_1"] for f in feeds] == [False, False, False, True]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (theirs - plain).abs().max() > 0.01  # the residuals changed the prediction


# {repeat: (the ControlNet's double and single blocks, the output each of the 3 double and 5 single blocks takes)}
FLUX_RULES = {
    False: ((2, 2), ["block_0", "block_0", "block_1", *["single_block_0"] * 3, *["single_block_1"] * 2]),
    True: ((2, 0), ["block_0", "block_1", "block_0", *[None] * 5]),  # XLabs': repeated, no single blocks
}


@pytest.mark.parametrize("repeat", FLUX_RULES)
def test_flux_blocks_take_diffusers_residuals(repeat):
    """Flux's per-block residual inputs, fed by the runner's rule from a ControlNet's outputs, give what
    diffusers' transformer gives from those residuals: k = 2 double-stream and k' = 2 single-stream blocks
    by the interval rule (3 double blocks: 0-1 take the first, 2 the second; 5 single blocks: 0-2 the first,
    3-4 the second), and XLabs' 2 double blocks repeated (`controlnet_blocks_repeat`: 0, 1, 0)."""
    from diffusers import FluxTransformer2DModel

    from export.families.flux import _TransformerForFlux
    from runners.families.flux.controlnet import FluxControlNets

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(in_channels=16, num_layers=3, num_single_layers=5, attention_head_dim=16,
                                         num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                         guidance_embeds=True, axes_dims_rope=[4, 6, 6]).eval()
    ids = np.stack(np.meshgrid(np.zeros(1), np.arange(4), np.arange(4), indexing="ij"), -1).reshape(-1, 3)
    inputs = (torch.randn(1, 16, 16), torch.randn(1, 5, 16), torch.randn(1, 8), torch.tensor([0.5]),
              torch.from_numpy(ids).float(), torch.zeros(5, 3), torch.tensor([3.5]))
    counts, taken = FLUX_RULES[repeat]
    kinds = dict(zip(("block", "single_block"), counts))
    out = {f"controlnet_{kind}_{j}": torch.randn(1, 16, 32).numpy() for kind, k in kinds.items() for j in range(k)}
    runner = object.__new__(FluxControlNets)
    runner.manifest = {"constants": {"double_layers": 3, "single_layers": 5, "controlnet_blocks_repeat": int(repeat)},
                       "submodules": {"controlnet": {"outputs": [{"name": n} for n in out]}}}
    specs = [{"name": f"double_residual_{i}"} for i in range(3)] + [{"name": f"single_residual_{j}"} for j in range(5)]
    feeds = runner._residual_feeds("controlnet", out, specs)
    samples = {kind: [torch.from_numpy(out[f"controlnet_{kind}_{j}"]) for j in range(k)] or None
               for kind, k in kinds.items()}
    with torch.no_grad():
        ours = _TransformerForFlux(transformer)(*inputs, *map(torch.from_numpy, feeds))[0]
        kwargs = dict(hidden_states=inputs[0], encoder_hidden_states=inputs[1], pooled_projections=inputs[2],
                      timestep=inputs[3], img_ids=inputs[4], txt_ids=inputs[5], guidance=inputs[6], return_dict=False)
        theirs = transformer(**kwargs, controlnet_block_samples=samples["block"],
                             controlnet_single_block_samples=samples["single_block"],
                             controlnet_blocks_repeat=repeat)[0]
        plain = transformer(**kwargs)[0]
    assert [next((n[len("controlnet_"):] for n, v in out.items() if v is f), None) for f in feeds] == taken
    assert all(not f.any() for f, name in zip(feeds, taken) if name is None)  # zeros
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (theirs - plain).abs().max() > 0.01  # the residuals changed the prediction


@pytest.mark.parametrize("setup", ["sd3_one", "flux_one"])
def test_transformer_plain_run_and_refusals(loaded, request, setup):
    """Without control_image, an artifact with a transformer family's ControlNet gives the base artifact's
    image (its transformer, exported again with residual inputs, gets zeros); and what diffusers has no
    pipeline for, or what a cached step would skip, is refused."""
    family = setup.split("_")[0]
    pipe, _ = loaded(setup)
    latents = np.random.default_rng(9).standard_normal((1, 16, 8, 8), dtype=np.float32)
    args = dict(prompt="a cat", height=64, width=64, num_inference_steps=2, output_type="np",
                latents=pipe.layout.as_diffusers(latents))
    plain = Pipeline.load(request.getfixturevalue(f"{family}_tiny_build").folder / "ort-fp32")
    # measured: sd3 below 1e-6, flux 2e-6 (another export's float rounding of the same graph)
    np.testing.assert_allclose(pipe(**args), plain(**args), rtol=0, atol=5e-6)
    control = edge_image(64, 64, seed=0)
    if family == "sd3":
        with pytest.raises(ValueError, match="control_image= with image to image: diffusers has no such sd3 "
                                             "ControlNet pipeline; sd3 ControlNets run for text to image"):
            pipe("a cat", image=smooth_image(64, 64), control_image=control, num_inference_steps=2)
    with pytest.raises(ValueError, match=f"control_image= with cache=first-block: {family}'s ControlNet residuals"):
        pipe("a cat", control_image=control, height=64, width=64, num_inference_steps=2, cache="first-block")
    with pytest.raises(ValueError, match="control_noise= is the control images' VAE sample: pass control_image="):
        pipe("a cat", control_noise=np.zeros((2, 16, 8, 8), np.float32), height=64, width=64, num_inference_steps=2)
    wrong = (2 if family == "flux" else 1, 16, 8, 8)
    with pytest.raises(ValueError, match=rf"control_noise have shape \({wrong[0]}, 16, 8, 8\); this request needs"):
        pipe("a cat", control_image=control, control_noise=np.zeros(wrong, np.float32), height=64, width=64,
             num_inference_steps=2)


@pytest.mark.parametrize("setup", ["sd3_one", "flux_one"])
def test_a_controlnet_pipeline_folder_exports_its_controlnet(loaded, request, shared_root, tmp_path, setup):
    """A folder saved by StableDiffusion3ControlNetPipeline or FluxControlNetPipeline exports its ControlNet
    beside the rest, as --controlnet adds one. (At the tiny model's ranges, the graphs are those of the
    fixture's export, taken as they are: what this tests is the folder's ControlNet found and wired.)"""
    import dataclasses
    import json

    from export.api import export_model
    from export.source import resolve

    _, reference = loaded(setup)
    reference.save_pretrained(tmp_path / "pipeline")
    src, tiny = resolve(str(tmp_path / "pipeline")), request.getfixturevalue(f"{setup.split('_')[0]}_tiny_build")
    ranges = {"image_size": tiny.source.entry.image_size, "text_length": tiny.source.entry.text_length}
    src = dataclasses.replace(src, entry=dataclasses.replace(src.entry, **ranges))
    onnx = export_model(src, tmp_path / "build", reuse_from=shared_root)
    manifest = json.loads((onnx / "manifest.json").read_text())
    assert manifest["submodules"]["controlnet"]["source"].endswith("pipeline/controlnet")
    added = json.loads((request.getfixturevalue(setup) / "onnx" / "manifest.json").read_text())
    for name in ("controlnet", "transformer"):
        assert manifest["submodules"][name]["inputs"] == added["submodules"][name]["inputs"]


def test_transformer_controlnets_check_their_base(sd3_tiny_build):
    """A ControlNet of another kind, one whose widths differ from the transformer's, or one of a kind not
    supported yet is refused with what to pass instead."""
    from export.families import controlnet_flux, controlnet_sd3
    from export.families.controlnet import controlnet_source
    from export.source import SourceError, resolve

    sd3 = sd3_tiny_build.source
    with pytest.raises(SourceError, match="holds no SD3ControlNetModel .*'ControlNetModel'.*sd3 takes a diffusers "
                                          "SD3ControlNetModel"):
        controlnet_source(controlnet_folder("sd15-controlnet-tiny"), "sd15-controlnet-tiny", sd3)
    with pytest.raises(SourceError, match="has inner_dim=16; sd3-tiny's transformer has 32: pass a ControlNet "
                                          "trained for this base model"):
        controlnet_sd3._check({**sd3.config("transformer"), "num_attention_heads": 2}, sd3, "x")
    with pytest.raises(SourceError, match="reads 2 channels beside the control image's latents; "
                                          "StableDiffusion3ControlNetInpaintingPipeline gives one"):
        controlnet_sd3._check({**sd3.config("transformer"), "extra_conditioning_channels": 2}, sd3, "x")
    with pytest.raises(SourceError, match="inpainting ControlNets .* and others run in different diffusers "
                                          "pipelines: export them apart"):
        controlnet_sd3._constants([{"extra_conditioning_channels": 1}, {}], sd3)
    flux = resolve("flux-tiny")
    config = flux.config("transformer")
    with pytest.raises(SourceError, match="has in_channels=384; flux-tiny's transformer has 64"):
        controlnet_flux._check({**config, "in_channels": 384}, flux, "x")
    with pytest.raises(SourceError, match=r"these ControlNets mix XLabs' kind .* diffusers runs one kind at a time"):
        controlnet_flux._constants([config, {**config, "conditioning_embedding_channels": 16}], flux)


@pytest.mark.parametrize("setup", ["sd15_one"])  # named for the sd15 tests' worker (conftest's groups)
def test_deep_cache_matches_the_library_with_a_controlnet(loaded, setup):
    """DeepCache with a ControlNet: the ControlNet runs at every step, as beside the library's helper, and the
    shallow branch takes its residual for conv_in's output."""
    pipe, reference = loaded(setup)
    kwargs = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=8)
    control, latents = edge_image(64, 64, seed=3), _latents(64, 64, seed=3)
    with library_deep_cache(reference, 2) as library_full:
        ref = reference(image=control, latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    ours = pipe(latents=latents, output_type="np", control_image=control, cache=DeepCacheConfig(cache_interval=2),
                **kwargs)
    assert (pipe.cache_stats["full"], pipe.cache_stats["cached"]) == (len(library_full), 9 - len(library_full))
    uncached = pipe(latents=latents, output_type="np", control_image=control, **kwargs)
    err, change = float(np.abs(ours - ref).max()), float(np.abs(ours - uncached).max())
    print(f"max abs error {err:.1e}, the cache's effect {change:.3f}")
    assert err <= ONE_LEVEL, err
    assert change > 10 * ONE_LEVEL, "the cache changed nothing: the test would prove nothing"
    assert_real_image(ref)


@pytest.mark.parametrize("setup", ["sd15_one"])
def test_two_threads_on_one_pipeline_keep_their_controls(loaded, setup):
    """The ControlRun of a call is in its conditions (runners/conditioning/controlnet.py), not on the pipeline."""
    calls = [dict(prompt="a photo of a cat", control_image=edge_image(64, 64, seed=k), height=64, width=64,
                  num_inference_steps=3, seed=k) for k in (1, 2)]
    assert_calls_keep_apart(loaded(setup)[0], calls)


def _patched_reference(monkeypatch, module, noise, encoder_noise):
    monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(encoder_noise))
    monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: torch.from_numpy(noise))


@pytest.mark.parametrize("task", ["image to image", "inpainting"])
def test_image_tasks_match_diffusers(monkeypatch, sd15_one, sd15_tiny_build, task):
    """StableDiffusionControlNetImg2ImgPipeline and StableDiffusionControlNetInpaintPipeline (the 4-channel
    UNet: the known part blended back), with their noise handed to both."""
    import importlib

    cls, module = {"image to image": ("StableDiffusionControlNetImg2ImgPipeline", "pipeline_controlnet_img2img"),
                   "inpainting": ("StableDiffusionControlNetInpaintPipeline", "pipeline_controlnet_inpaint")}[task]
    module = importlib.import_module(f"diffusers.pipelines.controlnet.{module}")
    reference = _reference(cls, sd15_tiny_build, ["sd15-controlnet-tiny"])
    height, width = 64, 128
    rng = np.random.default_rng(5)
    noise, encoder_noise = (rng.standard_normal((1, 4, height // 8, width // 8), dtype=np.float32) for _ in range(2))
    _patched_reference(monkeypatch, module, noise, encoder_noise)
    kwargs = dict(prompt="a photo of a cat", image=smooth_image(height, width, seed=2), height=height, width=width,
                  num_inference_steps=STEPS, strength=0.7, output_type="np",
                  **({"mask_image": soft_mask(height, width)} if task == "inpainting" else {}))
    control = edge_image(height, width, seed=4)
    ours = Pipeline.load(sd15_one / "ort-fp32")(control_image=control, noise=noise, encoder_noise=encoder_noise,
                                                **kwargs)
    ref = reference(control_image=control, **kwargs).images
    unused = reference(control_image=control, controlnet_conditioning_scale=0.0, **kwargs).images
    compare_controlled(ours, ref, unused)


def test_controlnets_are_added_without_exporting_the_rest(sd15_tiny_build, sd15_one, sd15_two):
    """Adding ControlNets to an export takes the graphs it has as they are (the same files, hard-linked)
    and exports only the new ControlNet."""
    import json

    base, one, two = (json.loads((f / "onnx" / "manifest.json").read_text())
                      for f in (sd15_tiny_build.folder, sd15_one, sd15_two))
    assert list(two["submodules"]) == [*base["submodules"], "controlnet", "controlnet_1"]
    assert two["submodules"]["controlnet_1"]["source"] == str(controlnet_folder("sd15-controlnet-tiny-2"))
    for name in base["submodules"]:
        assert two["submodules"][name]["export"] == base["submodules"][name]["export"]
        assert os.stat(sd15_tiny_build.folder / "onnx" / f"{name}.onnx").st_ino == \
            os.stat(sd15_two / "onnx" / f"{name}.onnx").st_ino
    assert os.stat(sd15_one / "onnx/controlnet.onnx").st_ino == os.stat(sd15_two / "onnx/controlnet.onnx").st_ino


def test_plain_run_is_unchanged_by_the_controlnet_engines(loaded, sd15_tiny_build):
    """Without control_image, an artifact with a ControlNet gives the base artifact's image exactly (the
    UNet's residual inputs get zeros)."""
    pipe, _ = loaded("sd15_one")
    latents = _latents(64, 64, seed=9)
    plain = Pipeline.load(sd15_tiny_build.folder / "ort-fp32")
    args = dict(prompt="a cat", height=64, width=64, num_inference_steps=2, latents=latents, output_type="np")
    np.testing.assert_array_equal(pipe(**args), plain(**args))


# ort-int8 against ort-fp32 with one ControlNet, measured with VNNI and 8-bit weights: sd15 62.2 dB (the tiny
# UNet is mostly convolutions, which stay float), sdxl 63.3, sd3 51.3, flux 57.9; with 7-bit weights (every CPU
# since: docs/precision.md) on a Zen 3: sd15 58.1, sdxl 60.3, sd3 48.1, flux 54.2. Bounds 5 to 10 dB under.
INT8_MIN_PSNR = {"sd15_one": 50.0, "sdxl_one": 53.0, "sd3_one": 41.0, "flux_one": 48.0}


# openvino-bf16 against ort-fp32 with one ControlNet, measured with AMX: sd15 52.5 dB (53.6 on one thread),
# flux 41.9. Bounds 5 dB under (a CPU without bf16 runs OpenVINO's bf16 hint in fp32, closer still).
BF16_MIN_PSNR = {"sd15_one": 47.5, "flux_one": 36.5}
OTHER_TARGETS = {("ort", "int8"): INT8_MIN_PSNR, ("openvino", "bf16"): BF16_MIN_PSNR}


def _controlled_call(pipe, setup: str) -> np.ndarray:
    """A 64x64 image of `setup`'s ControlNet case, from fixed latents and a fixed edge map."""
    channels = pipe.manifest["constants"]["latent_channels"]
    latents = np.random.default_rng(1).standard_normal((1, channels, 8, 8), dtype=np.float32)
    return pipe(prompt="a photo of a cat", height=64, width=64, num_inference_steps=STEPS, output_type="np",
                latents=pipe.layout.as_diffusers(latents),
                control_image=edge_image(64, 64, seed=0), seed=0)  # seed: SD3's control image VAE sample


@pytest.mark.parametrize("setup, target, precision",
                         [(setup, *artifact) for artifact, bounds in OTHER_TARGETS.items() for setup in bounds])
def test_other_targets_stay_close_to_fp32(loaded, request, setup, target, precision):
    """ort-int8 (its ControlNet quantized as the denoiser is) and openvino-bf16 against ort-fp32, one
    ControlNet case per family."""
    from bench.accuracy import psnr
    from engines.api import build_artifact

    fp32, _ = loaded(setup)
    other = Pipeline.load(build_artifact(request.getfixturevalue(setup), target, precision))
    if precision == "int8":
        assert other.manifest["submodules"]["controlnet"]["passes"][-1]["name"] == "quantize_int8"
    value = psnr(_controlled_call(other, setup), _controlled_call(fp32, setup))
    print(f"{setup}: {target}-{precision} vs ort-fp32: {value:.1f} dB")
    assert value > OTHER_TARGETS[target, precision][setup], value


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt-rtx is not installed")
@pytest.mark.parametrize("setup", ["flux_one"])  # a transformer with residual inputs; U-Nets build in test_family_targets
def test_tensorrt_rtx_builds_the_controlnets(loaded, request, setup, monkeypatch):
    """Real TensorRT-RTX engines (fp16) of the ControlNet and of the denoiser with its residual inputs, each
    profile covering its inputs; through the GPU stand-in (tests/gpu_double.py: ONNX Runtime's graphs held to
    the engines' profiles), the pipeline with a control image gives ort-fp32's image exactly."""
    from engines.api import build_artifact
    from gpu_double import SharedBuffers

    build, (fp32, _) = request.getfixturevalue(setup), loaded(setup)
    folder = build_artifact(build, "trt-rtx", "fp16", options=rtx_options(build))
    subs = manifest(folder)["submodules"]
    assert residual_inputs(subs["transformer"])
    for name in ("controlnet", "transformer"):
        assert (folder / subs[name]["file"]).stat().st_size > 100_000, name  # a serialized engine, not a stub
        assert set(subs[name]["engine"]["profile"]) == {t["name"] for t in subs[name]["inputs"]}, name
    double = SharedBuffers.install(monkeypatch, build / "ort-fp32")
    assert np.array_equal(_controlled_call(Pipeline.load(folder), setup), _controlled_call(fp32, setup))
    assert any(s.profile for s in double.opened)


@pytest.mark.parametrize("setup, denoiser", [("sd15_one", "unet"), ("sd3_one", "transformer"),
                                             ("flux_one", "transformer")])
def test_calibration_records_controlnet_calls(request, setup, denoiser):
    """The precisions that measure the model (fp16's islands, fp8's scales) see the ControlNet's calls too:
    one per denoiser call."""
    from engines.calibration import CalibrationSettings, collect, describe

    folder = request.getfixturevalue(setup)
    calls = describe(collect(folder / "ort-fp32", CalibrationSettings(prompts=1, steps=2, size=64)))["calls"]
    assert calls["controlnet"] == calls[denoiser] > 0, calls


@pytest.mark.parametrize("kwargs, said", [
    (dict(controlnet_conditioning_scale=0.5), "controlnet_conditioning_scale are ControlNet settings: pass "
                                              "control_image= too"),
    (dict(control_image=["edges.png", "pose.png"]), "control_image must be a PIL image, a numpy array"),
    (dict(control_image=[np.zeros((64, 64, 3))] * 3), r"control_image: this artifact has 2 ControlNets"),
    (dict(control_image=[np.zeros((64, 64, 3))] * 2, controlnet_conditioning_scale=[1.0]),
     r"controlnet_conditioning_scale=\[1.0\] is not allowed: pass a number, or a list of 2 numbers"),
    (dict(control_image=[np.zeros((64, 64, 3))] * 2, control_guidance_start=0.8, control_guidance_end=0.2),
     r"control_guidance_start=0.8 and control_guidance_end=0.2: use 0 <= start < end <= 1"),
])
def test_bad_requests_are_refused(sd15_two, kwargs, said):
    pipe = Pipeline.load(sd15_two / "ort-fp32")
    with pytest.raises(ValueError, match=said):
        pipe("a cat", height=64, width=64, num_inference_steps=1, **kwargs)


def test_cli_control_images_canny_and_scales(sd15_two, tmp_path):
    """--control-image and --canny fill the ControlNets in order, --control-scale gives one scale each, and
    the image takes the control image's size."""
    from PIL import Image

    from runners.__main__ import main

    edge_image(64, 128, seed=1).save(tmp_path / "edges.png")
    edge_image(64, 128, seed=5).save(tmp_path / "photo.png")
    out = tmp_path / "out.png"
    assert main([str(sd15_two / "ort-fp32"), "--prompt", "a cat", "--steps", "2", "--control-image",
                 str(tmp_path / "edges.png"), "--canny", str(tmp_path / "photo.png"), "--control-scale", "0.5",
                 "--control-scale", "0.8", "--out", str(out)]) == 0
    assert Image.open(out).size == (128, 64)


def test_controlnets_served_over_triton_and_the_openai_api(sd15_two, tmp_path):
    """A request carries one control image per ControlNet and their scales: Triton's inputs (N x H x W x 3, and
    N numbers; one number is every ControlNet's), the OpenAI API's JSON body (base64 files) and multipart body
    (a file or base64 field each, a repeated scale field). Each gives the Pipeline's image, which the scales
    change."""
    import base64
    import io

    import openai
    import requests
    import tritonclient.http as http
    from PIL import Image
    from tritonclient.utils import np_to_triton_dtype

    from runners.serving.repository import write_repository
    from test_openai_api import openai_client, pixels, png
    from test_serving import server_for

    artifact = sd15_two / "ort-fp32"
    controls = [edge_image(64, 64, seed=1), edge_image(64, 64, seed=5)]
    common = dict(height=64, width=64, num_inference_steps=2, seed=3)
    start = smooth_image(64, 64)
    with Pipeline.load(artifact) as pipe:
        expected = {scales: np.asarray(pipe("a cat", control_image=controls, controlnet_conditioning_scale=scales,
                                            **common)[0]) for scales in ((1.0, 0.5), (0.7, 0.7))}
        assert np.abs(expected[(1.0, 0.5)].astype(int) - expected[(0.7, 0.7)]).max() > 10
        edited = np.asarray(pipe("a cat", image=start, strength=0.6, control_image=controls,
                                 controlnet_conditioning_scale=[1.0, 0.5], **common)[0])
        with openai_client(pipe, "sd15-cn2") as client:
            encoded = [base64.b64encode(png(c)).decode() for c in controls]
            for scales in expected:
                got = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json", extra_body={
                    "control_image": encoded, "controlnet_conditioning_scale": list(scales), "seed": 3,
                    "num_inference_steps": 2})
                assert np.array_equal(pixels(got.data[0]), expected[scales]), scales
            with pytest.raises(openai.BadRequestError) as error:
                client.images.generate(prompt="a cat", size="64x64", extra_body={"control_image": ["not base64!"]})
            assert error.value.body["param"] == "control_image", error.value.body
            files = [("image", ("in.png", png(start), "image/png"))] + [
                ("control_image", (f"c{k}.png", png(c), "image/png")) for k, c in enumerate(controls)]
            fields = {"prompt": "a cat", "size": "64x64", "strength": "0.6", "seed": "3", "num_inference_steps": "2",
                      "controlnet_conditioning_scale": ["1.0", "0.5"]}
            answer = requests.post(f"{client.base_url}images/edits", data=fields, files=files, timeout=120)
            assert answer.status_code == 200, answer.text
            got = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
            assert np.array_equal(np.asarray(got), edited)
            scale_file = [("controlnet_conditioning_scale", ("s.txt", b"0.5", "text/plain"))]
            refused = requests.post(f"{client.base_url}images/edits", data=fields, files=files + scale_file,
                                    timeout=120)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "controlnet_conditioning_scale"
            # the openai client's edit sends extra_body's lists as repeated `name[]` fields: base64 control images
            got = client.images.edit(image=("in.png", png(start), "image/png"), prompt="a cat", size="64x64",
                                     response_format="b64_json", extra_body={
                                         "control_image": encoded, "controlnet_conditioning_scale": [1.0, 0.5],
                                         "strength": 0.6, "seed": 3, "num_inference_steps": 2})
            assert np.array_equal(pixels(got.data[0]), edited)
    repository = tmp_path / "repository"
    model = write_repository(artifact, repository)
    with server_for(repository) as server:
        client = http.InferenceServerClient(server.http_url)
        for scales in expected:
            fields = {"prompt": np.array([[b"a cat"]], object), "height": np.array([[64]], np.int32),
                      "width": np.array([[64]], np.int32), "num_inference_steps": np.array([[2]], np.int32),
                      "seed": np.array([[3]], np.int64),
                      "control_image": np.stack([np.asarray(c) for c in controls])[None],
                      "controlnet_conditioning_scale": np.array([list(dict.fromkeys(scales))], np.float32)}
            inputs = [http.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype)) for name, a in fields.items()]
            for tensor, array in zip(inputs, fields.values()):
                tensor.set_data_from_numpy(array)
            images = client.infer(model.name, inputs).as_numpy("images")
            assert_served_image(images[0, 0], expected[scales], scales)


def test_canny_edges(monkeypatch):
    """OpenCV's edge map as RGB (white on black), and one line saying how to install it when it is missing."""
    import sys

    from runners.conditioning.controlnet import canny_edges

    edges = np.asarray(canny_edges(edge_image(64, 64, seed=1), 50, 100))
    assert edges.shape == (64, 64, 3) and set(np.unique(edges)) == {0, 255}
    monkeypatch.setitem(sys.modules, "cv2", None)
    with pytest.raises(ValueError, match=r"canny edge maps need OpenCV: pip install 'diffusion-aot\[canny\]'"):
        canny_edges(smooth_image(64, 64))
