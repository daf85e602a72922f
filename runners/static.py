"""Static shapes: the one request a `--static` TensorRT artifact's engines take.

A static engine accepts exactly one shape per input, so the build must fix the shapes the runner
will call each engine with for that request, not the opt value of every dim (batch opt is 2 for
every submodule, but the text encoders run at the prompt count). The manifest records the request
(`static`) and each engine's shapes (`static_shapes`); the runner refuses any other request in one
line before an engine runs, and any other engine call (a direct `vae_decode`, another text length)
before it reaches TensorRT.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from runners.latents import LatentLayout


@dataclass(frozen=True)
class StaticRequest:
    height: int | None = None  # pixels; None: the model's default image size
    width: int | None = None
    prompts: int = 1
    images_per_prompt: int = 1
    guidance: bool = True  # classifier-free guidance doubles the denoiser's batch

    @property
    def images(self) -> int:
        return self.prompts * self.images_per_prompt

    def batch(self, submodule: str, pipeline: dict) -> int:
        """The batch the runner calls `submodule` at: the denoiser at the image count (twice that with
        guidance), the VAE at the image count, a text encoder at the prompt count (the negative
        prompts are a second call of the same size)."""
        # the denoiser, its other graphs (First-Block Cache's) and the ControlNets, which run beside it
        if submodule.startswith((pipeline["denoiser"], "controlnet")):
            return self.images * (2 if self.guidance else 1)
        if submodule.startswith("vae_"):
            return self.images
        return self.prompts

    def dims(self, submodule: str, pipeline: dict) -> dict[str, int]:
        scale = pipeline["vae_scale_factor"]
        latent = {"height": self.height // scale, "width": self.width // scale}
        # latent_height_S: the latent side over S (a UNet's ControlNet residuals, down to 1/32)
        residual_sides = {f"latent_{axis}_{2 ** k}": side // 2 ** k for axis, side in latent.items() for k in range(1, 6)}
        layout = LatentLayout(patch=pipeline.get("patch_size", 1))  # a transformer's image tokens: its patches
        return {"batch": self.batch(submodule, pipeline), "image_height": self.height, "image_width": self.width,
                "latent_height": latent["height"], "latent_width": latent["width"], **residual_sides,
                "image_tokens": layout.tokens((latent["height"], latent["width"]))}

    def resolved(self, pipeline: dict, dims: dict) -> "StaticRequest":
        """With the default size filled in, checked against the export's ranges (ValueError if outside)."""
        # Flux: its T5 length follows each request (SD3's runs at the export's own), which a static request does not fix
        if "image_tokens" in dims and "text_length" in dims and pipeline.get("text_max_length") is None:
            raise ValueError("--static is not supported for Flux: its transformer's image token count and T5 length "
                             "follow each request, and a static request fixes only the batch and image size; build "
                             "without --static")
        if "latent_frames" in dims:
            raise ValueError("--static fixes an image request (size, prompts, images); a video model's engines also "
                             "take its frame count, which it does not fix: build without --static")
        size = pipeline["default_image_size"]
        request = replace(self, height=self.height or size, width=self.width or size)
        multiple = pipeline["vae_scale_factor"] * pipeline["latent_multiple"]
        for name in ("height", "width"):
            value, (lo, _, hi) = getattr(request, name), dims[f"image_{name}"]
            if value % multiple or not lo <= value <= hi:
                raise ValueError(f"static {name}={value} is not allowed: use a multiple of {multiple} from {lo} to {hi} "
                                 "(the range the model was exported for)")
        if min(request.prompts, request.images_per_prompt) < 1:
            raise ValueError(f"static prompts={request.prompts}, images per prompt={request.images_per_prompt}: "
                             "both must be at least 1")
        lo, _, hi = dims["batch"]
        batch = request.batch(pipeline["denoiser"], pipeline)
        if not lo <= batch <= hi:
            raise ValueError(f"a static build for {request.describe()} runs the denoiser at batch {batch}; the export "
                             f"allows {lo} to {hi}: ask for fewer prompts or images")
        return request

    def describe(self) -> str:
        return (f"{self.height}x{self.width}, {self.prompts} prompt(s), {self.images_per_prompt} image(s) per prompt, "
                f"{'with' if self.guidance else 'without'} guidance")

    def record(self) -> dict:
        return asdict(self)


def check_static_request(manifest: dict, height: int, width: int, prompts: int, per_prompt: int,
                         guidance: bool) -> None:
    """Refuse a request a static artifact's engines cannot run, naming the one they take."""
    if "static" not in manifest:
        return
    built = StaticRequest(**manifest["static"])
    asked = StaticRequest(height, width, prompts, per_prompt, guidance)
    if asked != built:
        raise ValueError(f"this artifact's engines are static: they run {built.describe()} only, and this request is "
                         f"{asked.describe()}. Ask for that, or build without --static (or --static for this "
                         "request's size, prompts, images and guidance)")


def check_feeds(submodule: str, entry: dict, feeds: dict) -> None:
    """Refuse an engine call whose input shapes are not the static engine's."""
    shapes = entry.get("static_shapes")
    if not shapes:
        return
    for name, array in feeds.items():
        if list(array.shape) != shapes[name]:
            raise ValueError(f"{submodule} is a static engine: input {name} takes shape {tuple(shapes[name])}, "
                             f"not {tuple(array.shape)}. Build without --static for other shapes")
