"""Calibration inputs: what every engine receives while the fp32 artifact makes images from a
fixed set of prompts, recorded once and cached by hash under <build>/calibration/<key>/.

Precision passes measure the model on them: `to_fp16` the activation ranges that decide its fp32
islands, `quantize_fp8` the activation scales. Every denoising step of every prompt is recorded,
so the transformer is measured at every timestep it will see. The VAE encoder, which text to
image does not call, is fed the images the pipeline made. An inpainting denoiser (SD1.5's 9
channels), which text to image cannot run, inpaints a seeded picture instead. An artifact with
ControlNets runs them with seeded control images, so their calls are recorded too. An artifact with a
tiny autoencoder feeds it what its VAE is fed.

The run is deterministic (prompt i uses seed i), and the key covers the fp32 artifact, the
settings and the prompts, so the same build reuses the same calibration.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from runners.caches import graph_caches  # the package: every cache registered
from runners.manifest import atomic_folder, digest, exclusive, is_current, read_manifest, write_manifest
from runners.options import declared
from runners.pipeline import VAE_ENGINES, Pipeline

# The step caches that run a graph beside the denoiser (runners/caches/), each taking one of its outputs: the graphs
# are recorded beside every call of their denoiser, so that a calibrated build calibrates them too.
COMPANIONS = graph_caches()


def _companions(pipe) -> list[tuple[str, str, str]]:
    """(graph, the denoiser graph it goes beside, the denoiser output it takes) of each step cache's graph the
    pipeline was loaded with: the denoiser's (transformer_first_block beside transformer), and a handover's second's
    (transformer_2_first_block beside transformer_2)."""
    denoiser = pipe.constants["denoiser"]
    return [(graph, engine, c.output) for c in COMPANIONS for engine in pipe.sessions
            for graph in [c.graph_for(denoiser, None if engine == denoiser else engine)]
            if graph != engine and graph in pipe.opened]

# What a recording holds, in its key: older recordings, which lack the tiny autoencoder's calls, are made again.
RECORDED = "engine calls, the tiny autoencoder's fed as the VAE's"

PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a red fox in fresh snow, telephoto, golden hour",
    "an oil painting of a lighthouse in a storm",
    "a bowl of ramen with a soft-boiled egg, top view",
    "a city street at night in the rain, neon signs reflected in puddles",
    "a watercolor of cherry blossoms over a river",
    "a close-up portrait of an old fisherman with a grey beard",
    "a cozy reading nook with a cat asleep on a pile of books",
    "a futuristic train crossing a desert canyon",
    "a macro photo of a dew drop on a spider web",
    "a medieval castle on a cliff above the sea, fantasy art",
    "a minimalist logo of a mountain and the sun, flat vector",
    "a sign that says 'OPEN 24 HOURS' above a diner door",
    "a golden retriever puppy playing in autumn leaves",
    "an isometric illustration of a tiny island with a windmill",
    "a bustling market in Marrakech, vivid colors",
    "a black and white photo of a jazz trio on stage",
    "a glass of iced coffee on a marble table, product photo",
    "a snowy mountain range under the northern lights",
    "a pixel art knight fighting a dragon",
    "an architectural rendering of a wooden house in a forest",
    "a hummingbird feeding from a red flower, high shutter speed",
    "a stack of pancakes with blueberries and maple syrup",
    "a child's crayon drawing of a family and a house",
    "an underwater coral reef with a sea turtle",
    "a steampunk airship above Victorian London",
    "a bonsai tree in a ceramic pot, studio lighting",
    "a vintage poster for a trip to the moon",
    "a field of sunflowers under a thunderstorm sky",
    "a robot barista pouring latte art",
    "a detailed pencil sketch of a human hand",
    "",  # the empty prompt: what the negative branch of guidance sees
)


# The defaults (BENCHMARKS.md, "Calibration settings": python -m bench --tables calibration). On sd3-bench every
# setting from 32 prompts x 8 steps at 512 down to 4 x 2 at 256 gave an OpenVINO int8 image within 0.1 dB of the
# first's, but a U-Net's activations change with the timestep: on sd15-bench (SD1.5 at its real size) 4 x 2 at 256
# lost 9.9 dB against 32 x 8 at 512 and 4 x 8 at 256 0.4 dB; sd15-tiny's test image lost 16 dB at 4 x 2 and 3-4 dB
# at 4 x 4. So few prompts, a schedule's worth of steps, and a small size: a recording's time grows
# with its pixels and calls, and at 1024x1024 NNCF's int8 statistics of SD3's real VAE decoder did not fit a 24 GiB
# machine at all (the OpenVINO int8 build of sd3-bench was killed for memory).
LARGEST_DEFAULT_SIZE = 256


@dataclasses.dataclass(frozen=True)
class CalibrationSettings:
    prompts: int = 4  # the first N of PROMPTS
    steps: int = 8  # denoising steps per prompt: all of them are recorded
    size: int | None = None  # image side in pixels; None: the model's default size, at most LARGEST_DEFAULT_SIZE
    guidance_scale: float = 7.0

    def side(self, default: int, least: int) -> int:
        """The image side recorded at: the settings' own, else the model's `default` up to LARGEST_DEFAULT_SIZE and
        no less than the export's `least`."""
        return self.size or max(least, min(default, LARGEST_DEFAULT_SIZE))

    def __post_init__(self):
        if not 1 <= self.prompts <= len(PROMPTS):
            raise ValueError(f"calibration prompts={self.prompts}: use 1 to {len(PROMPTS)}")
        if self.steps < 1:
            raise ValueError(f"calibration steps={self.steps}: use 1 or more")


def _log(msg: str) -> None:
    print(f"[calibration] {msg}", flush=True)


def time_left(elapsed: float, done: int, total: int) -> str:
    """What a progress line adds after `done` of `total` equal parts took `elapsed` seconds: the time the rest
    will take at the mean pace so far ("" when none is left). At a real model's size a calibration runs for
    hours: the user sees at the first prompt what waiting costs."""
    if done >= total:
        return ""
    left = round(elapsed / done * (total - done))
    if left < 60:
        return f" (about {left} s left)"
    hours, rest = divmod(left, 3600)
    return f" (about {f'{hours} h ' if hours else ''}{rest // 60} min {rest % 60} s left)"


def recordings_folder(artifact: Path, artifact_key: str, settings: CalibrationSettings) -> Path:
    """Where `collect` keeps the recordings of the artifact whose cache key is `artifact_key`: named by
    their own key, which a build plan knows before the artifact exists."""
    key = digest([RECORDED, artifact_key, dataclasses.asdict(settings), PROMPTS[:settings.prompts]])
    return Path(artifact).parent / "calibration" / key


def collect(artifact: Path, settings: CalibrationSettings = CalibrationSettings()) -> Path:
    """Record every engine call of the fp32 ORT `artifact` (its caller builds it) over the
    calibration prompts, and return the folder beside it that holds them."""
    dest = recordings_folder(artifact, read_manifest(artifact, verify=False)["cache_key"], settings)
    with exclusive(dest):  # the same recordings made elsewhere at once: made once, then reused
        if is_current(dest, dest.name):
            _log(f"{dest} is up to date: reusing it")
            return dest
        return _record(artifact, settings, dest)


def _record(artifact: Path, settings: CalibrationSettings, dest: Path) -> Path:
    prompts, key = PROMPTS[:settings.prompts], dest.name
    with atomic_folder(dest) as tmp:
        store = _FeedStore(tmp)
        pipe = Pipeline.load(artifact, verify=False)
        pipe.recorder = _with_tiny_vae(pipe, store.record)
        for graph, denoiser, output in _companions(pipe):
            pipe.open_cache_graph(graph)  # a cache's graph opens at its first use: here, beside every denoiser call
            pipe.run = _CompanionRecorder(pipe, store, graph, denoiser, output)
        size = settings.side(pipe.constants["default_image_size"], pipe.dims["image_height"][0])
        inpainting = pipe.inpainting_denoiser()
        started = time.monotonic()
        # a family whose pipeline has no guidance_scale (Qwen-Image 2.1's) calibrates at its default guidance
        guidance = {"guidance_scale": settings.guidance_scale} if "guidance_scale" in declared(pipe) else {}
        for i, prompt in enumerate(prompts):
            image = pipe(prompt, seed=i, height=size, width=size, num_inference_steps=settings.steps, output_type="np",
                         **guidance, **_call_inputs(pipe, size, seed=i))
            if "vae_encoder" in pipe.sessions and not inpainting:  # inpainting fed it already
                pipe.calibration_encode(image)
            _log(f"prompt {i + 1}/{len(prompts)} recorded{time_left(time.monotonic() - started, i + 1, len(prompts))}")
        calls = store.finish()
        write_manifest(tmp, {"stage": "calibration", "cache_key": key,
                             "settings": {**dataclasses.asdict(settings), "size": size},
                             "prompts": list(prompts), "seeds": list(range(len(prompts))), "calls": calls,
                             "seconds": round(time.monotonic() - started, 1)})
    _log(f"wrote {dest}")
    return dest


def _call_inputs(pipe, size: int, seed: int) -> dict:
    """What a calibration call gives besides the prompt: an image and a mask to an inpainting denoiser, control
    images to ControlNets or FLUX.1 Canny/Depth, a reference image at the calibration size where the family asks
    for one, a video's frame count (`calibration_options`: FLUX.1 Kontext's reference at every call, FLUX.2 klein
    KV's at every other)."""
    inputs = _inpainting_inputs(size, seed) if pipe.inpainting_denoiser() else {}
    control_images = pipe.control_images()
    if control_images:
        inputs.update(control_inputs(size, control_images, seed))
    inputs.update(pipe.calibration_options(_inpainting_inputs(size, seed)["image"], seed))
    return inputs


def _inpainting_inputs(size: int, seed: int) -> dict:
    """An inpainting denoiser runs only on an image and a mask: a smooth seeded picture, and a
    centred rectangle of a seeded size to repaint."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    image = np.stack([0.5 + 0.45 * np.sin(rng.uniform(2, 8) * x + rng.uniform(2, 8) * y + rng.uniform(0, 6))
                      for _ in range(3)], axis=-1)
    half = rng.uniform(0.15, 0.4)
    mask = ((np.abs(y - 0.5) < half) & (np.abs(x - 0.5) < half)).astype(np.float32)
    return {"image": image, "mask_image": mask}


def control_inputs(size: int, count: int, seed: int) -> dict:
    """An artifact that takes control images (ControlNets, FLUX.1 Canny/Depth) runs on them at every
    calibration prompt: a seeded edge-like control image each (thin bright lines on black, as canny maps are)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    images = []
    for _ in range(count):
        field = np.sin(rng.uniform(4, 16) * x + rng.uniform(0, 6)) * np.sin(rng.uniform(4, 16) * y + rng.uniform(0, 6))
        edges = (np.abs(field) < 0.08).astype(np.float32)
        images.append(np.repeat(edges[..., None], 3, axis=-1))
    return {"control_image": images if count > 1 else images[0]}


def describe(folder: Path) -> dict:
    """What the manifest of an artifact built from this calibration records about it."""
    data = read_manifest(folder, verify=False)
    return {"key": data["cache_key"], "settings": data["settings"], "prompts": data["prompts"],
            "seeds": data["seeds"], "calls": data["calls"],
            **({"seconds": data["seconds"]} if "seconds" in data else {})}  # what the recording took


class _CompanionRecorder:
    """A step cache's graph beside a denoiser graph (COMPANIONS) takes the denoiser's inputs (those it declares) and
    one of the denoiser's outputs: every call of that denoiser is recorded for it too, with that output of the
    call's first step (stored once per prompt). Replaces the pipeline's `run`."""

    def __init__(self, pipe, store: "_FeedStore", graph: str, denoiser: str, output: str):
        self.pipe, self.run, self.store, self.graph, self.denoiser = pipe, pipe.run, store, graph, denoiser
        self.output = output
        self.accepted = {i["name"] for i in pipe.manifest["submodules"][graph]["inputs"]}
        self.call, self.value = None, None

    def __call__(self, submodule: str, release: bool = True, **feeds):
        out = self.run(submodule, release=release, **feeds)
        if submodule == self.denoiser:
            call = self.pipe._calls.current
            if self.call is not call:  # a new pipeline call
                self.call, self.value = call, np.array(out[self.output])
            self.store.record(self.graph, {**{k: v for k, v in feeds.items() if k in self.accepted},
                                           self.output: self.value})
        return out


def _with_tiny_vae(pipe, record):
    """`record`, and for an artifact with a tiny autoencoder (`python -m export --tiny-vae`), which the
    pipeline does not call beside its VAE: a call of the tiny decoder on every latent the VAE decodes (in the
    tiny one's scaling) and of the tiny encoder on every image the VAE encodes, recorded too."""
    decoder, encoder = VAE_ENGINES["tiny"]
    if decoder not in pipe.sessions:
        return record
    (scaling, shift), (tiny_scaling, tiny_shift) = pipe.vae_factors("full"), pipe.vae_factors("tiny")

    def recorder(submodule: str, feeds: dict) -> None:
        record(submodule, feeds)
        if submodule == VAE_ENGINES["full"][0]:  # latents / scaling + shift: back to the denoiser's, then on
            latents = (feeds["latent"] - np.float32(shift)) * np.float32(scaling)
            pipe.run(decoder, latent=latents / np.float32(tiny_scaling) + np.float32(tiny_shift))
        elif submodule == VAE_ENGINES["full"][1] and encoder in pipe.sessions:
            pipe.run(encoder, image=feeds["image"])
    return recorder


class _FeedStore:
    """Each distinct input array is stored once (the text embeddings repeat at every step)."""

    def __init__(self, folder: Path):
        self.folder = folder
        (folder / "arrays").mkdir(parents=True)
        self.calls: dict[str, list[dict[str, str]]] = {}

    def record(self, submodule: str, feeds: dict[str, np.ndarray]) -> None:
        names = {}
        for name, array in feeds.items():
            array = np.ascontiguousarray(array)
            h = hashlib.sha1(array.tobytes() + str((array.dtype, array.shape)).encode()).hexdigest()
            path = self.folder / "arrays" / f"{h}.npy"
            if not path.exists():
                np.save(path, array)
            names[name] = h
        self.calls.setdefault(submodule, []).append(names)

    def finish(self) -> dict[str, int]:
        (self.folder / "calls.json").write_text(json.dumps(self.calls))
        return {name: len(calls) for name, calls in self.calls.items()}


class CalibrationFeeds:
    """The recorded inputs of one submodule, read lazily: `for feeds in CalibrationFeeds(...)`."""

    def __init__(self, folder: Path, submodule: str):
        self.folder = Path(folder)
        self.submodule = submodule
        calls = json.loads((self.folder / "calls.json").read_text())
        if submodule not in calls:
            raise ValueError(f"{self.folder} recorded no calls of {submodule} (it has: {', '.join(calls)})")
        self._calls = calls[submodule]

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {name: np.load(self.folder / "arrays" / f"{h}.npy") for name, h in self._calls[i].items()}

    @functools.cached_property
    def _shapes(self) -> list[tuple]:
        """Each call's input shapes, read from the arrays' headers."""
        return [tuple((name, np.load(self.folder / "arrays" / f"{h}.npy", mmap_mode="r").shape)
                      for name, h in sorted(call.items())) for call in self._calls]

    @functools.cached_property
    def _by_shape(self) -> list[int]:
        """The calls' indices, those of the same input shapes together (in recorded order within each): a
        tool that stacks the activations of the calls it collects at a time (`chunk`) needs them alike.
        (Z-Image's caption length is each call's own.)"""
        return sorted(range(len(self)), key=lambda i: self._shapes[i])

    def reader(self):
        """The same feeds as ONNX Runtime's quantization tools read them, those of one shape together
        (`_by_shape`), in ranges when a tool collects a few calls at a time (`CalibStridedMinMax`)."""
        from onnxruntime.quantization import CalibrationDataReader

        feeds = self

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.set_range(0, len(feeds))

            def __len__(self):
                return len(feeds)

            def set_range(self, start_index: int, end_index: int):
                self._next, self._end = start_index, end_index

            def get_next(self):
                if self._next >= self._end:
                    return None
                self._next += 1
                return feeds[feeds._by_shape[self._next - 1]]

        return Reader()

    def chunk(self, most: int = 8) -> int:
        """The largest number of calls, up to `most`, that divides the recording evenly into ranges of
        one input shape each (in `reader`'s order): a tool that keeps every activation of the calls it
        collects holds only that many at a time, and stacks them."""
        shapes = [self._shapes[i] for i in self._by_shape]
        return max(d for d in range(1, most + 1) if len(self) % d == 0
                   and all(len(set(shapes[k:k + d])) == 1 for k in range(0, len(self), d)))
