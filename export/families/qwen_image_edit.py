"""Qwen-Image-Edit (QwenImageEditPipeline, and QwenImageEditPlusPipeline with several input images): Qwen-Image's
transformer, VAE and scheduler (export/families/qwen_image.py), the input images' latents beside the image's on
the transformer's token axis (each image a frame after it in the rotary positions), and a text encoder that
reads the images too: Qwen2.5-VL's vision tower (`image_encoder`) and its language model with the image's
tokens in the prompt (`text_encoder`).

The vision tower's Python bookkeeping (which patches share a window, each patch's rotary position, the order
it reads them in) is the runner's (runners/families/qwen_image_edit/vision.py): the graph takes the patches laid out
window by window, each window padded to its full size, with each row's position and segment (its image, -1
for padding). Its window layers attend within each window's rows, its full-attention layers within a segment,
both as one batched attention with an additive mask: nothing data-dependent remains in the graph, and one graph
serves any number of images of any size. The language model takes the tower's tokens at the prompt's image
tokens (`image_states`: zeros elsewhere) and its 3D rotary positions as inputs.
"""
from __future__ import annotations

import functools
import json
import sys

import torch

from export.families import qwen_image
from export.families.first_block import transformer_specs
from export.families.llm_encoder import LLMHiddenStates
from export.spec import Family, PromptFormat, SubmoduleSpec, TensorSpec as T

# The Edit pipelines' template (both the same but for where the images go): its first 64 tokens' states dropped
SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
          "background), then explain how the user's text instruction should alter or modify the image. Generate a "
          "new image that meets the user's requirements while maintaining consistency with the original input "
          "where appropriate.<|im_end|>\n<|im_start|>user\n")
PROMPT_TEMPLATE = SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
DROP_TOKENS = 64
IMAGE_AREA = 1024 * 1024  # the input images' VAE area (the pipelines' calculate_dimensions target)


def image_area(src) -> int:
    """The input images' VAE area: the pipelines'; a tiny test model's registry entry may set a smaller one
    (extra["image_area"]) to keep its tests within their time, which then patch diffusers' to match."""
    return src.entry.extra.get("image_area", IMAGE_AREA)


def diffusers_at_area(area: int) -> list[tuple[object, str, object]]:
    """(module, attribute, value)s that make diffusers' Edit pipelines (QwenImageEditPipeline, its inpainting and
    Plus twins) size input images, and the output by default, to `area` instead of their 1024 x 1024 pixels', as
    our runner does with an artifact's `image_area` (a tiny model's): their calculate_dimensions at that target
    (the Plus pipeline's VAE_IMAGE_SIZE is one too; its 384 x 384 vision input stays)."""
    from diffusers.pipelines.qwenimage import (pipeline_qwenimage_edit, pipeline_qwenimage_edit_inpaint,
                                               pipeline_qwenimage_edit_plus)

    def at_area(real):
        return lambda target, ratio: real(area if target == IMAGE_AREA else target, ratio)
    return [(module, "calculate_dimensions", at_area(module.calculate_dimensions)) for module in
            (pipeline_qwenimage_edit, pipeline_qwenimage_edit_inpaint, pipeline_qwenimage_edit_plus)]


REFERENCES = 3  # the input images an export's token range makes room for (EditPlus takes several)
VISION_WINDOWS = 100  # about one 1024 x 1024 image's windows (37 x 37 merged patches, 4 x 4 a window)


def _vision(src) -> dict:
    return src.config("text_encoder")["vision_config"]


def _window_units(vision: dict) -> int:
    return vision["window_size"] // vision["spatial_merge_size"] // vision["patch_size"]


def vision_attention(attn, x, cos, sin, mask):
    """transformers' vision attention of a Qwen VL model (Qwen2.5-VL's, Qwen3-VL's: one qkv projection, rotary
    positions from its own module's apply_rotary_pos_emb_vision) over (groups, rows) with an additive mask."""
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision
    groups, rows, _ = x.shape
    q, k, v = attn.qkv(x).reshape(groups * rows, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = rotate(q, k, cos, sin)
    q, k, v = (t.reshape(groups, rows, attn.num_heads, -1).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
    return attn.proj(out.transpose(1, 2).reshape(groups, rows, -1))


class _VisionTower(torch.nn.Module):
    """Qwen2.5-VL's vision tower on patches laid out window by window: (windows, window rows, patch values),
    each row's (row, column) position and segment -> (windows, merged tokens a window, width)."""

    def __init__(self, model):
        super().__init__()
        self.model = model  # the component: its weights keep their checkpoint names under one prefix
        self.__dict__["visual"] = model.model.visual if hasattr(model, "model") else model.visual  # not a second child
        self.full = set(self.visual.fullatt_block_indexes)

    def forward(self, pixel_values, positions, segments):
        windows, rows, _ = pixel_values.shape
        visual = self.visual
        x = visual.patch_embed(pixel_values.reshape(windows * rows, -1))
        cos, sin = visual.rotary_pos_emb(x, positions.reshape(windows * rows, 2))

        def additive(seg):  # rows of a segment see each other only (padding only itself)
            return torch.where(seg[..., :, None] == seg[..., None, :], 0.0, torch.finfo(x.dtype).min)[:, None]

        masks = {False: additive(segments), True: additive(segments.reshape(1, -1))}
        for i, block in enumerate(visual.blocks):
            full = i in self.full
            shape = (1, windows * rows, -1) if full else (windows, rows, -1)
            x = x + vision_attention(block.attn, block.norm1(x).reshape(shape), cos, sin, masks[full]).reshape(x.shape)
            x = x + block.mlp(block.norm2(x))
        return (visual.merger(x).reshape(windows, rows // visual.spatial_merge_unit, -1),)


class VLHiddenStates(LLMHiddenStates):
    """The language model's hidden states with the vision tower's tokens at the image tokens (image_states:
    zeros elsewhere) and its 3D rotary positions given."""

    def __init__(self, model, layers, final_norm: bool = True):
        super().__init__(model, layers, final_norm)
        self.image_token = model.config.image_token_id

    def forward(self, input_ids, attention_mask, position_ids, image_states):
        return self.read(inputs_embeds=self.embeds(input_ids, image_states), attention_mask=attention_mask,
                         position_ids=position_ids)

    def embeds(self, input_ids, image_states):
        """The token embeddings, the vision tower's tokens in place at the image tokens."""
        embeds = self.stack.embed_tokens(input_ids)
        return torch.where((input_ids == self.image_token)[..., None], image_states.to(embeds.dtype), embeds)


IMAGE_ENCODER = SubmoduleSpec(
    name="image_encoder",
    component="text_encoder",
    inputs=(T("pixel_values", "float32", ("vision_windows", "window_rows", "patch_values")),
            T("positions", "int64", ("vision_windows", "window_rows", 2), high=64),
            T("segments", "int64", ("vision_windows", "window_rows"), low=-1, high=2)),
    outputs=(T("image_embeds", "float32", ("vision_windows", "window_tokens", "text_width")),),
    wrap=_VisionTower,
)
TEXT_ENCODER = SubmoduleSpec(
    name="text_encoder",
    component="text_encoder",
    inputs=(T("input_ids", "int64", ("batch", "text_length"), high="text_vocab"),
            T("attention_mask", "int64", ("batch", "text_length"), mask=True),
            T("position_ids", "int64", (3, "batch", "text_length"), high="text_length"),
            T("image_states", "float32", ("batch", "text_length", "text_width"))),
    outputs=(T("hidden_states", "float32", ("batch", "text_length", "text_width")),),
    wrap=functools.partial(VLHiddenStates, layers=qwen_image.TEXT_LAYERS),
    load_kwargs={"attn_implementation": "eager"},  # as llm_encoder's
)


def _image_tokens(dims: dict[str, int]) -> int:
    """The transformer's token axis: the image's, then its input images' (none at the range's min and opt)."""
    return qwen_image.image_tokens(dims) + dims.get("reference_tokens", 0)


def _constants(src) -> dict[str, int]:
    vision = _vision(src)
    merge, units = vision["spatial_merge_size"], _window_units(vision)
    scale = qwen_image.scale(src.config("vae")) * qwen_image.PATCH
    return {
        **qwen_image.constants(src),
        # an input image's tokens at the most elongated sizes calculate_dimensions gives: 5% above the area's
        "reference_tokens_max": REFERENCES * image_area(src) // scale**2 * 105 // 100,
        "vision_windows_max": REFERENCES * VISION_WINDOWS * 2,
        "vision_windows_opt": VISION_WINDOWS,
        "window_rows": units**2 * merge**2,
        "window_tokens": units**2,
        # RGB: "in_channels" as transformers 5 writes it, "in_chans" in Qwen2.5-VL's own config
        "patch_values": vision.get("in_channels", vision.get("in_chans", 3)) * vision["temporal_patch_size"]
        * vision["patch_size"] ** 2,
    }


def vision_constants(src, vision: dict) -> dict:
    """The runner's VisionConfig (runners/families/qwen_image_edit/vision.py): the vision tower's patches and the
    image processor's pixel budget and normalisation, from the folder's processor/preprocessor_config.json."""
    processor = json.loads((src.folder / "processor" / "preprocessor_config.json").read_text())
    return {"patch": vision["patch_size"], "merge": vision["spatial_merge_size"],
            "temporal": vision["temporal_patch_size"],
            **({"window": vision["window_size"]} if "window_size" in vision else {}),
            "min_pixels": processor.get("min_pixels", processor.get("size", {}).get("shortest_edge")),
            "max_pixels": processor.get("max_pixels", processor.get("size", {}).get("longest_edge")),
            "mean": processor["image_mean"], "std": processor["image_std"]}


def _runtime_constants(src) -> dict:
    return {
        **qwen_image.runtime_constants(src),
        "several_images": src.model_index().get("_class_name") == "QwenImageEditPlusPipeline",
        "image_area": image_area(src),
        "references": REFERENCES,
        "image_token_id": src.config("text_encoder")["image_token_id"],
        "vision": vision_constants(src, _vision(src)),
    }


def processor(image_processor, tokenizer, chat_template=None, kind: str = "Qwen2VLProcessor"):
    """transformers' processor class `kind` (Qwen2VLProcessor, Qwen3VLProcessor) of these parts and no video
    processor. transformers checks every part's class, and the video processor's needs torchvision, which PyPI
    builds only against CUDA's torch; the pipelines use images alone. (A user's environment with torchvision
    loads the folder's processor as it is.)"""
    import transformers
    from transformers import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: arg is None or check(self, name, arg)
    try:
        return getattr(transformers, kind)(image_processor, tokenizer, chat_template=chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def load_processor(folder, kind: str = "Qwen2VLProcessor"):
    """The folder's processor (processor/), as `processor` builds it."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = f"{folder}/processor"
    tokenizer = AutoTokenizer.from_pretrained(path)
    return processor(Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer, tokenizer.chat_template, kind)


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """A QwenImageEditPipeline (or configs' pipeline_class) folder: qwen_image's with the Edit template's system
    turn whole in the tokenizer, and the processor's files beside it (its PIL image processor at Qwen2.5-VL's
    pixel budget, written part by part: transformers' processor cannot save without its video processor)."""
    from pathlib import Path

    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    qwen_image.build_random({"pipeline_class": "QwenImageEditPipeline", **configs}, out_dir, seed,
                            prefix=SYSTEM, drop=DROP_TOKENS, later=("processor",))
    out_dir = Path(out_dir)
    AutoTokenizer.from_pretrained(out_dir / "tokenizer").save_pretrained(out_dir / "processor")
    # Qwen2.5-VL-7B-Instruct's preprocessor_config.json: 56 x 56 to 12845056 pixels
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056).save_pretrained(out_dir / "processor")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


FAMILY = Family(
    name="qwen_image_edit",
    pipeline_classes=("QwenImageEditPipeline", "QwenImageEditInpaintPipeline", "QwenImageEditPlusPipeline"),
    submodules=(
        IMAGE_ENCODER,
        TEXT_ENCODER,
        *transformer_specs(qwen_image.TRANSFORMER),
        qwen_image.VAE_DECODER,
        qwen_image.VAE_ENCODER,
    ),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={**qwen_image.FAMILY.derived_dims, "image_tokens": _image_tokens},
    tokenizers=("tokenizer",),
    build_random=build_random,
    prompt_formats={"tokenizer": PromptFormat(template=PROMPT_TEMPLATE, drop_tokens=DROP_TOKENS, padding="longest")},
)
