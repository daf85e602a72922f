"""The model registry: the tiny and bench entries keep the real models' structure, with real tokenizers."""
from __future__ import annotations

import json

import pytest

from export.registry import MODELS
from export.source import SourceError, resolve


def test_hub_models_are_registered_by_their_ids():
    assert MODELS["sd3"].hub_id == "stabilityai/stable-diffusion-3-medium-diffusers"
    assert MODELS["sd3.5-medium"].hub_id == "stabilityai/stable-diffusion-3.5-medium"
    assert MODELS["sd3.5-large"].hub_id == "stabilityai/stable-diffusion-3.5-large"
    assert (MODELS["sd15"].family, MODELS["sd15"].hub_id) == ("sd15", "stable-diffusion-v1-5/stable-diffusion-v1-5")
    assert (MODELS["sdxl"].family, MODELS["sdxl"].hub_id) == ("sdxl", "stabilityai/stable-diffusion-xl-base-1.0")
    assert (MODELS["sd15-inpaint"].family, MODELS["sd15-inpaint"].hub_id) == (
        "sd15", "stable-diffusion-v1-5/stable-diffusion-inpainting")


def test_sd15_inpaint_tiny_is_sd15_tiny_with_the_inpainting_unet():
    """stable-diffusion-inpainting's UNet differs from SD1.5's only by its 9 input channels: the
    latents, the mask and the masked image's latents."""
    tiny, inpaint = MODELS["sd15-tiny"].random_configs, MODELS["sd15-inpaint-tiny"].random_configs
    assert inpaint["unet"] == {**tiny["unet"], "in_channels": 9}
    assert inpaint["pipeline_class"] == "StableDiffusionInpaintPipeline"
    assert {k: v for k, v in inpaint.items() if k not in ("unet", "pipeline_class")} == \
        {k: v for k, v in tiny.items() if k != "unet"}


def _parameters(make) -> int:
    import torch

    with torch.device("meta"):  # shapes only: no memory, no time
        return sum(p.numel() for p in make().parameters())


def test_sd15_bench_is_the_real_sd15_architecture():
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = MODELS["sd15-bench"].random_configs
    assert _parameters(lambda: UNet2DConditionModel(**cfg["unet"])) == 859_520_964  # SD1.5's UNet
    assert _parameters(lambda: CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"]))) == 123_060_480  # CLIP ViT-L/14
    assert _parameters(lambda: AutoencoderKL(**cfg["vae"])) == 83_653_863


def test_wan_bench_has_wan21_13bs_widths_and_its_real_vae():
    """wan-bench's transformer is Wan 2.1 1.3B's at 2 of its 30 blocks (at 30, its 1,418,996,800 parameters); its VAE
    is Wan 2.1's whole (Wan2.1_VAE's 127 M: 508 MB in fp32)."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    cfg = MODELS["wan-bench"].random_configs
    with torch.device("meta"):
        two, three = (_parameters(lambda n=n: WanTransformer3DModel(**{**cfg["transformer"], "num_layers": n}))
                      for n in (2, 3))
        assert two + 28 * (three - two) == 1_418_996_800
        assert _parameters(lambda: AutoencoderKLWan(**cfg["vae"])) == 126_892_531


def test_wan_fullsize_is_wan21_14bs_transformer():
    """wan-fullsize's transformer is Wan 2.1 14B's at its true shapes: 40 blocks, 14,288,491,584 parameters (28.6 GB
    in fp16); only it gets weights."""
    import torch
    from diffusers import WanTransformer3DModel

    cfg = MODELS["wan-fullsize"].random_configs
    with torch.device("meta"):
        assert _parameters(lambda: WanTransformer3DModel(**cfg["transformer"])) == 14_288_491_584
    assert cfg["weights_for"] == ["transformer"] and MODELS["wan-fullsize"].export_dtype == "float16"


def test_qwen_image_fullsize_is_qwen_images_transformer_and_qwen2_5_vl_7b():
    """qwen-image-fullsize: Qwen-Image's transformer at its true shapes (60 blocks, 20,430,401,088 parameters) and
    Qwen2.5-VL-7B's language model (7,070,619,136), their fp16 weights drawn at export."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = MODELS["qwen-image-fullsize"].random_configs
    config = Qwen2_5_VLConfig(text_config=cfg["text_encoder"], vision_config=cfg["vision"])
    with torch.device("meta"):
        assert _parameters(lambda: QwenImageTransformer2DModel(**cfg["transformer"])) == 20_430_401_088
        assert _parameters(lambda: Qwen2_5_VLForConditionalGeneration(config).model.language_model) == 7_070_619_136
    assert cfg["weights_for"] == ["transformer", "text_encoder"] and cfg["weights_drawn"]


@pytest.mark.parametrize("name, blocks, cross", [("sd15-tiny", 4, ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"]),
                                                 ("sdxl-tiny", 3, ["DownBlock2D"] + ["CrossAttnDownBlock2D"] * 2)])
def test_unet_tiny_entries_keep_the_real_block_structure(name, blocks, cross):
    cfg = MODELS[name].random_configs
    unet = cfg["unet"]
    assert len(unet["block_out_channels"]) == blocks and unet["down_block_types"] == cross
    assert unet["up_block_types"] == [b.replace("Down", "Up") for b in cross[::-1]]
    assert cfg["vae"]["latent_channels"] == unet["in_channels"] == 4
    if name == "sdxl-tiny":  # the added conditions: six size values and CLIP-G's pooled projection
        width = cfg["text_encoder"]["hidden_size"] + cfg["text_encoder_2"]["hidden_size"]
        assert unet["cross_attention_dim"] == width
        assert unet["projection_class_embeddings_input_dim"] == (6 * unet["addition_time_embed_dim"]
                                                                 + cfg["text_encoder_2"]["projection_dim"])


def test_sd3_tiny_keeps_the_structure_of_sd3_medium(tiny_source):
    cfg = tiny_source.config
    tr, vae = cfg("transformer"), cfg("vae")
    assert tr["in_channels"] == tr["out_channels"] == vae["latent_channels"] == 16
    assert tr["patch_size"] == 2
    assert len(vae["block_out_channels"]) == 4  # VAE scale factor 8
    clip_l, clip_g, t5 = cfg("text_encoder"), cfg("text_encoder_2"), cfg("text_encoder_3")
    assert clip_l["hidden_size"] + clip_g["hidden_size"] < t5["d_model"] == tr["joint_attention_dim"]
    assert clip_l["projection_dim"] + clip_g["projection_dim"] == tr["pooled_projection_dim"]
    assert t5["feed_forward_proj"] == "gated-gelu"
    index = json.loads((tiny_source.folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder"][1] == index["text_encoder_2"][1] == "CLIPTextModelWithProjection"


def test_sd3_tiny_tokenizers_load_through_from_pretrained(tiny_source):
    from transformers import AutoTokenizer

    clip = AutoTokenizer.from_pretrained(tiny_source.folder / "tokenizer")
    assert clip("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]  # CLIP's real ids
    assert len(clip) == 49408 and clip.model_max_length == 77
    assert AutoTokenizer.from_pretrained(tiny_source.folder / "tokenizer_2").pad_token == "!"
    t5 = AutoTokenizer.from_pretrained(tiny_source.folder / "tokenizer_3")
    ids = t5("a photo of a cat").input_ids
    assert ids[-1] == t5.eos_token_id == 1 and t5.unk_token_id not in ids


def test_unknown_model_lists_the_known_names():
    with pytest.raises(SourceError, match="unknown model 'sd4'.*sd3-tiny"):
        resolve("sd4")


def test_folder_that_is_not_a_pipeline(tmp_path):
    with pytest.raises(SourceError, match="no model_index.json"):
        resolve(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "AuraFlowPipeline"}))
    with pytest.raises(SourceError, match="AuraFlowPipeline; supported pipelines: ") as refused:
        resolve(str(tmp_path))
    named = str(refused.value).split("supported pipelines: ")[1].split(", ")
    assert {"FluxControlNetPipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusionXLControlNetInpaintPipeline",
            "ZImagePipeline"} <= set(named)


def test_hub_model_without_offline_weights_says_how_to_pass_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SourceError, match="not in the Hugging Face cache.*MODEL=/path/to/stable-diffusion-3-medium"):
        resolve("sd3")


def test_random_model_key_covers_code_and_libraries(monkeypatch, tmp_path):
    """A random-weight folder is rebuilt when its configs, the code that writes it, or the library
    versions that code drives change (the cache must not hand back a stale model)."""
    from pathlib import Path

    import export.source as source

    entry = MODELS["sd3-tiny"]
    key = source._random_key(entry)
    assert source._random_key(entry) == key
    real = source.package_versions
    monkeypatch.setattr(source, "package_versions", lambda names: {**real(names), "diffusers": "0.0.1"})
    assert source._random_key(entry) != key
    monkeypatch.undo()
    code = tmp_path / "export"
    (code / "families").mkdir(parents=True)
    for name in ("random_weights.py", "offline_tokenizers.py", "families/sd3.py"):
        (code / name).write_text((Path(source.__file__).parent / name).read_text() + "\n# changed\n")
    monkeypatch.setattr(source, "__file__", str(code / "source.py"))
    assert source._random_key(entry) != key


def test_building_a_random_model_leaves_its_key_as_it_was(monkeypatch, tmp_path):
    """The family's builder gets a copy of the entry's configs: transformers' config classes fill in nested dicts
    they are given (Qwen2.5-VL's rope_scaling gains rope_theta), which changed the key in the building process, so
    that the next `resolve` there built the model a second time under another name."""
    import dataclasses
    import json

    import export.source as source

    def build_random(configs, out_dir):  # what Qwen2_5_VLConfig does to the rope_scaling it is handed
        configs["text_encoder"]["rope_scaling"]["rope_theta"] = 1e6
        (out_dir / "model_index.json").write_text(json.dumps({}))

    entry = MODELS["qwen-image-tiny"]
    assert "rope_scaling" in entry.random_configs["text_encoder"]
    monkeypatch.setenv("DIFFUSION_AOT_CACHE", str(tmp_path))
    family = source.FAMILIES[entry.family]
    monkeypatch.setitem(source.FAMILIES, entry.family, dataclasses.replace(family, build_random=build_random))
    key = source._random_key(entry)
    folder = source._build_random(entry)
    assert folder.name.endswith(key) and source._random_key(entry) == key
    assert "rope_theta" not in entry.random_configs["text_encoder"]["rope_scaling"]


def test_random_model_key_leaves_out_what_has_keys_of_its_own(monkeypatch, tmp_path):
    """A change to the code of the random ControlNets or tiny autoencoders rebuilds those, not every model
    (their folders have keys of their own); a change to a family's builders still rebuilds the model."""
    import shutil
    from pathlib import Path

    import export.source as source

    code = tmp_path / "export"
    shutil.copytree(Path(source.__file__).parent, code, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(source, "__file__", str(code / "source.py"))
    entry = MODELS["sd3-tiny"]
    key = source._random_key(entry)
    for name in ("tiny_vae.py", "controlnet.py", "controlnet_sd3.py"):
        with open(code / "families" / name, "a") as f:
            f.write("\n# changed\n")
    assert source._random_key(entry) == key
    with open(code / "families" / "parts.py", "a") as f:
        f.write("\n# changed\n")
    assert source._random_key(entry) != key


def _hub_error(name: str):
    """The error the hub client raises for `name`: its HTTP errors by class name (made without the
    HTTP response their constructor reads: no request exists), or a full disk."""
    from huggingface_hub import errors

    if name == "disk full":
        return OSError(28, "No space left on device")
    cls = getattr(errors, name)
    error = cls.__new__(cls)
    Exception.__init__(error, {"GatedRepoError": "401", "RepositoryNotFoundError": "404",
                               "HfHubHTTPError": "503"}[name] + " error")
    return error


@pytest.mark.parametrize("error, message", [
    ("GatedRepoError",
     r"'sd3' \(stabilityai/stable-diffusion-3-medium-diffusers\) is gated: accept its license on the hub and log in"),
    ("RepositoryNotFoundError", "was not found on the hub, or it is private and your token cannot read it"),
    ("HfHubHTTPError", "downloading 'sd3' .* failed: 503 error"),
    ("disk full", "failed writing to disk: .*No space left on device"),
])
def test_hub_errors_are_reported_as_what_they_are(monkeypatch, error, message):
    """Only a model that is not cached and cannot be fetched says "not in the cache"; a gated or
    unknown repository, an HTTP error or a full disk says what happened."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def snapshot_download(repo_id, local_files_only=False):
        if local_files_only:
            raise LocalEntryNotFoundError("not in the cache")
        raise _hub_error(error)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(SourceError, match=message):
        resolve("sd3")


def test_ltx_bench_has_ltx_2bs_widths_and_090s_vae():
    """ltx-bench's transformer is LTX-Video 2B's transformer/config.json (Lightricks/LTX-Video) at 2 of its 28 blocks,
    its VAE 0.9.0's vae/config.json whole, its text encoder T5-XXL's widths."""
    cfg = MODELS["ltx-bench"].random_configs
    real_transformer = {"activation_fn": "gelu-approximate", "attention_bias": True, "attention_head_dim": 64,
                        "attention_out_bias": True, "caption_channels": 4096, "cross_attention_dim": 2048,
                        "in_channels": 128, "norm_elementwise_affine": False, "norm_eps": 1e-06,
                        "num_attention_heads": 32, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
                        "qk_norm": "rms_norm_across_heads"}
    assert {**cfg["transformer"], "num_layers": 28} == {**real_transformer, "num_layers": 28}
    real_vae = {"block_out_channels": [128, 256, 512, 512], "decoder_causal": False, "encoder_causal": True,
                "latent_channels": 128, "layers_per_block": [4, 3, 3, 3, 4], "patch_size": 4, "patch_size_t": 1,
                "resnet_norm_eps": 1e-06, "scaling_factor": 1.0, "spatio_temporal_scaling": [True, True, True, False]}
    assert {k: cfg["vae"][k] for k in real_vae} == real_vae
    assert (cfg["text_encoder"]["d_model"], cfg["text_encoder"]["d_ff"], cfg["text_encoder"]["num_heads"]) == \
        (4096, 10240, 64)
