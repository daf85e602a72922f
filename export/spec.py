"""The data that describes a model family: its submodules, their tensors and their axes.

A tensor's shape is a tuple of ints and names. A name is either a *dynamic* dimension
(batch, latent_height, ...), whose min/opt/max range comes from the model's registry entry,
or a *constant* of the pipeline (latent_channels, clip_width, ...) read from its configs.
Adding a family means writing one of these descriptions, not a new path through the stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

Shape = tuple[int | str, ...]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "int64"
    shape: Shape
    # Example values: floats are standard normal unless `high` is set, then uniform in [0, high);
    # integers (token ids) are uniform in [low, high). `high` may name a constant, or a dynamic dimension:
    # then up to its size, included (a length along that axis).
    high: int | str | None = None
    low: int = 0
    # A right-padded attention mask (int64): its examples are ones up to a random length per row, at least 1.
    mask: bool = False


@dataclass(frozen=True)
class SubmoduleSpec:
    name: str  # file and manifest key: "transformer"
    component: str  # attribute of the diffusers pipeline it comes from: "transformer", "vae"
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Wraps the pipeline component into a torch module whose forward takes the inputs
    # positionally and returns the outputs as a tuple, in the order declared above.
    wrap: Callable[[Any], Any]
    load_kwargs: dict = field(default_factory=dict)  # e.g. T5 needs eager attention to export
    # How the precision passes treat it (engines/precisions.py): "denoiser": True marks the
    # submodule run at every step (fp8 quantizes only it); "keep_scopes" names the modules (path
    # components of the exporter's name scopes, or whole paths where they hold a dot) whose linear
    # layers stay in float when quantized;
    # "fp32_scopes" names modules to_fp16 (and an fp16 export) keeps in fp32 (Flux's timestep
    # embedding); "fp32_inputs" names inputs an fp16 export takes in fp32 (the timesteps it feeds it);
    # "activations": True quantizes activations too where a target's int8 quantizes whole
    # submodules (engines/targets/_openvino_int8.py), as it does the denoiser's.
    quantization: dict = field(default_factory=dict)
    # ModelSource -> whether this description is the one the source's component needs, where a family
    # describes a component in variants (Flux's transformer with or without a guidance input). None: always.
    when: Callable[[Any], bool] | None = None
    # What the graph's deepest level divides the latent side by (a U-Net's down-sampling, a transformer's
    # patch: a constant's name; 1: the latent itself), or None where it takes no latent. The export's example
    # must give that level a side of at least 2 (export/shapes.py, check_example_size).
    latent_divisor: int | str | None = None
    # Where the graph is cut from a trace it shares with another submodule's instead of traced alone: (the
    # description traced, the function that turns a copy of that trace into this graph, (onnx-ir model, this
    # description) -> None, in place). A transformer's graph and its first-block graph share one
    # (export/families/first_block.py): tracing the first block alone traced the embedders and block 0 twice.
    cut_from: tuple[SubmoduleSpec, Callable[[Any, SubmoduleSpec], None]] | None = None

    def applies(self, src) -> bool:
        return src.has(self.component) and (self.when is None or self.when(src))


@dataclass(frozen=True)
class PromptFormat:
    """How a pipeline puts prompts to an LLM's tokenizer; the export renders it into the manifest
    (export/prompt_formats.py) and the runner applies it without transformers (runners/text.py)."""

    chat: dict | None = None  # apply_chat_template's keywords ({"enable_thinking": True}); None: no chat template
    system: str | None = None  # a system turn before the prompt's (FLUX.2 dev's system message)
    parts: bool = False  # each turn's content a list of typed parts, as processors' templates take it
    generation_prompt: bool = True  # the template's assistant header after the prompt
    removed: tuple[str, ...] = ()  # text the pipeline removes from each prompt first (FLUX.2 dev: "[IMG]")
    template: str | None = None  # or the pipeline's own format string around the prompt, with one "{}"
    drop_tokens: int = 0  # the template's leading tokens whose hidden states the pipeline drops (Qwen-Image)
    # "max_length": padded to the request's max_sequence_length (the pipeline reads the padding's states);
    # "longest": to the call's longest prompt (it reads only each prompt's own tokens, of a causal encoder)
    padding: str = "max_length"


@dataclass(frozen=True)
class Family:
    name: str
    # The diffusers classes whose model_index.json this family exports (text to image first; the
    # image-to-image and inpainting pipelines share its submodules).
    pipeline_classes: tuple[str, ...]
    submodules: tuple[SubmoduleSpec, ...]
    # ModelSource -> {constant name: int}: the fixed sizes used in shapes, read from the configs.
    constants: Callable[[Any], dict[str, int]]
    # ModelSource -> what the runner needs to chain the engines (scaling factors, text lengths...).
    runtime_constants: Callable[[Any], dict[str, Any]]
    # dynamic dims that are pure functions of others: dim -> (source dim, factor, offset), or a function
    # of all the base dims ({dim: size} -> size) where one source is not enough (Flux's image token count).
    derived_dims: dict[str, tuple[str, int, int] | Callable[[dict[str, int]], int]]
    tokenizers: tuple[str, ...]  # pipeline components holding tokenizers
    # (component configs, output folder) -> writes a random-weight pipeline of this family.
    build_random: Callable[[dict, Any], None]
    scheduler: str = "scheduler"
    # Its tiny autoencoder among madebyollin's (a hub id under madebyollin/: taesd, taesd3, ...), or None
    tiny_vae: str | None = None
    # {tokenizer component: how the pipeline formats prompts for it (or ModelSource -> that, where variants of
    # the family differ)}, for those that are not plain
    prompt_formats: dict[str, PromptFormat | Callable[[Any], PromptFormat]] = field(default_factory=dict)


@dataclass(frozen=True)
class ControlNetKind:
    """The ControlNets a family takes (export/families/controlnet.py), as data and small functions."""

    class_name: str  # the diffusers class their config.json names: "ControlNetModel"
    # (ControlNet config, base ModelSource, the name the user gave) -> raises SourceError with what to do
    check: Callable[[dict, Any, str], None]
    # ControlNet config -> its engine's description (named "controlnet"; the export renames the others)
    spec: Callable[[dict], SubmoduleSpec]
    # (ControlNet configs, base ModelSource) -> the constants the engines' shapes and the runner name
    constants: Callable[[list[dict], Any], dict]
    # (base ModelSource, seed, folder) -> writes a random test ControlNet for the base model into folder
    build_random: Callable[[Any, int, Any], None]
    # (base ModelSource, ControlNet configs) -> the base's descriptions that differ beside ControlNets, in place
    # of those of the same names (SD3's, Flux's and Z-Image's transformer takes their residuals only then: Z-Image's
    # at the layers the ControlNets add to). None: none differ.
    controlled: Callable[[Any, list[dict]], tuple[SubmoduleSpec, ...]] | None = None
    # ControlNet config -> the base component whose weights the ControlNet takes from its pipeline, which its
    # folder lacks (SD3.5 Large's take their transformer's patch embedding), or None
    borrows: Callable[[dict], str | None] = lambda config: None
    # (config, ControlNet folder, base ModelSource, out folder) -> writes into `out` the ControlNet with those
    # weights, as its pipeline runs it (its own weights linked, not copied)
    complete: Callable[[dict, Any, Any, Any], None] | None = None
    # (module, class) that loads the staged ControlNet where its diffusers class cannot (Z-Image's, which holds
    # the modules its pipeline lends it from the transformer); None: the diffusers class
    loader: tuple[str, str] | None = None
