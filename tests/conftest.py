"""Shared fixtures: the sd3-tiny pipeline exported and built once per test session."""
from __future__ import annotations

import inspect
import json
import logging
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Each xdist worker gets its share of the cores, before numpy and torch are imported (they read these at
# import) and for the subprocesses tests start: the runtimes' default of a thread per core, in two
# processes on the same cores, spin against each other (a tiny pipeline's steps took twice as long).
# Each worker is also pinned to cores of its own: OpenVINO's and NNCF's compiles and statistics still start a
# thread per core, whose spinning took the other worker's core (Z-Image's targets test: 70 s of CPU in 56 s
# unpinned, 56 s pinned, the same wall time). The whole suite on a fresh clone, 2-core Xeon: 29:09 unpinned,
# 27:56 and 29:02 pinned (within the spread of runs).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    _pinnable = hasattr(os, "sched_getaffinity")  # Linux; elsewhere the thread share only
    _cores = sorted(os.sched_getaffinity(0)) if _pinnable else list(range(os.cpu_count() or 1))
    _share = max(1, len(_cores) // _workers)
    for _variable in ("DIFFUSION_AOT_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_variable, str(_share))
    if _pinnable and len(_cores) >= _workers:
        _worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
        os.sched_setaffinity(0, _cores[_worker * _share:][:_share])

from runners.backends import cpu_threads  # noqa: E402
from runners.backends.openvino import avoid_one_thread_amx_crash  # noqa: E402
from engines.targets.openvino import without_usage_telemetry  # noqa: E402

# Before any test compiles an OpenVINO model in this process (oneDNN reads its ISA cap once).
avoid_one_thread_amx_crash(cpu_threads(None))
without_usage_telemetry()  # the tests that call OpenVINO's converter themselves send none either

import numpy as np  # noqa: E402 (after the thread settings above)
import pytest  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
logging.getLogger("torch.onnx").setLevel(logging.ERROR)

# What the code of a test, or of a fixture it uses, says when it exports and builds a tiny model (about
# a minute each): such a test is in the `export` tier, which `make test-fast` leaves out (`-m "not
# export"`). `request.getfixturevalue(...)` asks for a fixture at run time, where the fixture closure
# cannot show it: in this suite, always a build. `python -m bench` exports the model it measures.
EXPORTING_CODE = ("export_model(", "build_artifact(", "_tiny_build(", "getfixturevalue(", '"-m", "bench"')


def needs_export(item: pytest.Item) -> bool:
    """Whether a test needs an export: by its own code, or that of any fixture it uses, directly or not."""
    if item.get_closest_marker("export"):
        return True
    functions = [getattr(item, "function", None)]
    fixture_info = getattr(item, "_fixtureinfo", None)
    for definitions in (fixture_info.name2fixturedefs.values() if fixture_info else ()):
        functions += [d.func for d in definitions if d.baseid]  # baseid "" holds pytest's own fixtures
    return any(code in _source(f) for f in functions if f is not None for code in EXPORTING_CODE)


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def pytest_configure(config):
    config.addinivalue_line("markers", "export: needs a tiny model exported and built (left out by `make test-fast`)")


# Tests that run last: the bench smoke test finds up to date every artifact the tests before it built
# (its build folders link them), and builds only what no test did.
RUN_LAST = ("test_bench_smoke.py",)


# `make test` runs on every core (pytest-xdist, `--dist loadgroup`): the tests of one module and family
# go to one worker, which makes their module fixtures once. A test's family is the one its parameters
# name (sd15, sdxl, flux in "[sd15-int8]"), else the one its fixtures do (sd15_one, sd15_tiny_build);
# sd3-tiny's tests, the default model's, stay with their module's. The session's builds are shared by
# every worker (`shared_root`): a worker that needs a build another worker is making waits for it
# (runners.manifest.exclusive).
FAMILY = re.compile(r"(?:^|[-_\[])(sd3|sd15|sdxl|flux)(?=$|[-_\]])")


def _family(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    named = [f"[{callspec.id}]"] if callspec else []
    found = next(filter(None, map(FAMILY.search, named + [f"[{f}]" for f in item.fixturenames])), None)
    return found.group(1) if found and found.group(1) != "sd3" else None


def _group(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    if item.path.name in RUN_LAST and callspec:  # each family's smoke run its own group: the last groups of
        return f"{item.path.name}::{callspec.id}"  # the run spread over the workers (one held 5 minutes of them)
    family = _family(item)
    return f"{item.path.name}::{family}" if family else item.path.name


# Seconds each group took in a whole run on two workers (`--durations=0`, setup included: a group that waits for a
# build another worker makes pays the wait), on a 2-core Xeon with AMX (2026-12-07, an empty model and trace cache:
# 1660 s of test time, 14:44). They only order the groups, longest first (the Makefile's `--no-loadscope-reorder`
# keeps this order; xdist's own is by test count), so that both workers end together; rough numbers do. A group not
# listed goes after these, as short.
GROUP_SECONDS = {
    "test_family_targets.py::sd15": 120, "test_bench_smoke.py::sd3": 110, "test_wan.py": 80, "test_wan_ti2v.py": 70,
    "test_z_image.py": 60, "test_qwen_image_edit.py": 60, "test_openvino.py": 60, "test_trt.py": 60,
    "test_serving.py": 50, "test_flux2.py": 50, "test_family_targets.py::sdxl": 50, "test_controlnet.py::flux": 50,
    "test_ltx.py": 50, "test_qwen_image21.py": 40, "test_wan21_i2v.py": 40, "test_qwen_image.py": 40,
    "test_controlnet.py::sd15": 40, "test_passes.py": 40, "test_bench_smoke.py::wan": 40,
    "test_family_targets.py::flux": 30, "test_precision.py": 30, "test_image_to_image.py::sdxl": 20,
    "test_flux_conditioned.py::flux": 20, "test_controlnet.py": 20, "test_bench_smoke.py::ltx": 20,
    "test_bench_smoke.py::sd15": 20, "test_lazy_export.py": 20, "test_controlnet.py::sdxl": 20,
    "test_lora.py::flux": 20, "test_wan22_i2v.py": 10, "test_build_plan.py": 10, "test_lora_openvino.py": 10,
    "test_tiny_vae.py": 10, "test_flux.py::flux": 10, "test_bench_smoke.py::qwen_image_edit": 10,
    "test_bench_smoke.py::flux": 10, "test_lora.py": 10, "test_bench_smoke.py::flux2": 10,
    "test_bench_smoke.py::qwen_image": 10, "test_bench_smoke.py::z_image": 10, "test_memory.py": 10,
    "test_lora_openvino.py::sdxl": 10, "test_docs_commands.py": 10, "test_lora_openvino.py::sd15": 10,
    "test_engines.py": 10, "test_runner_errors.py": 10, "test_image_to_image.py": 10, "test_tiny_vae.py::sdxl": 10,
    "test_serving.py::flux": 10, "test_tiny_vae.py::sd15": 10, "test_streamed_parity.py": 10,
    "test_image_to_image.py::sd15": 10, "test_scale.py": 10, "test_lora_openvino.py::flux": 10,
    "test_streamed_parity.py::flux": 10,
}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the tests' ids
def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
        if needs_export(item):
            item.add_marker("export")
    # stable: the order within each group is kept
    items.sort(key=lambda item: (item.path.name in RUN_LAST, -GROUP_SECONDS.get(_group(item), 0)))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """A worker of `--dist loadgroup` whose tests' ids lack their group (a pytest that pytest-xdist cannot
    append it to) would have its groups scattered over the workers, each making its module's fixtures
    again: stop the run instead of doubling it."""
    if getattr(session.config.option, "loadgroup", False) and not all("@" in item.nodeid for item in session.items):
        raise pytest.UsageError("pytest-xdist could not add the worker groups to the tests' ids: "
                                "use the lock's pytest (constraints.txt)")


@pytest.fixture(scope="session")
def tiny_source():
    from export.source import resolve

    return resolve("sd3-tiny")


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory) -> Path:
    """The folder of the session's builds: the run's own, which every xdist worker of it shares; or, for a
    developer's inner loop, DIFFUSION_AOT_TEST_BUILDS=DIR, kept across runs (builds found up to date by
    their cache keys are reused, as in one run)."""
    if os.environ.get("DIFFUSION_AOT_TEST_BUILDS"):
        kept = Path(os.environ["DIFFUSION_AOT_TEST_BUILDS"]).resolve()
        kept.mkdir(parents=True, exist_ok=True)
        return kept
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_build(shared_root, tiny_source):
    """build/ folder with onnx/ and ort-fp32/ for sd3-tiny."""
    return _tiny_build(shared_root, tiny_source).folder


@pytest.fixture(scope="session")
def tiny_artifact(tiny_build):
    return tiny_build / "ort-fp32"


@pytest.fixture(scope="session")
def tiny_memory_artifact(tiny_build):
    """ort-fp32 with the memory profile (`--memory`): its passes planned at the export's opt shapes."""
    from engines.api import build_artifact

    return build_artifact(tiny_build, "ort", "fp32", memory=True)


@pytest.fixture(scope="session")
def reference_pipeline(tiny_source):
    """diffusers' own StableDiffusion3Pipeline on the same weights."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_source.folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def sd3_adapters(tiny_source, tmp_path_factory):
    """A: the transformer's attention and the first CLIP's; B: the transformer's feed-forward and
    adaLN projections (fused by fuse_qkv with others) and the second CLIP's attention (diffusers
    saves SD3 adapters for the transformer and the two CLIPs)."""
    from diffusers import StableDiffusion3Pipeline

    from lora_adapters import ATTENTION, CLIP_ATTENTION, make_adapter

    folder = tmp_path_factory.mktemp("sd3-loras")
    a = make_adapter(StableDiffusion3Pipeline, tiny_source.folder, folder / "a",
                     {"transformer": ATTENTION, "text_encoder": CLIP_ATTENTION}, seed=1)
    b = make_adapter(StableDiffusion3Pipeline, tiny_source.folder, folder / "b",
                     {"transformer": ["ff.net.2", "norm1.linear", "add_q_proj"], "text_encoder_2": ["q_proj", "v_proj"]},
                     seed=2, rank=2, alpha=2.0)
    return {"a": a, "b": b}


@pytest.fixture(scope="session")
def flux_adapters(flux_tiny_build, tmp_path_factory):
    """A: the attention of both kinds of block, the single blocks' MLP input (fused with their q, k, v)
    and CLIP's attention; B: the feed-forward, the adaLN projections (fused by fuse_qkv) and the final
    projection; kohya's Flux format and ComfyUI's of random FLUX.1-named layers."""
    from diffusers import FluxPipeline

    from lora_adapters import (ATTENTION, CLIP_ATTENTION, FLUX_ORIGINAL, flux_original_adapter,
                               make_adapter)

    folder, src = tmp_path_factory.mktemp("flux-loras"), flux_tiny_build.source.folder
    return {
        "a": make_adapter(FluxPipeline, src, folder / "a", {"transformer": ATTENTION + ["proj_mlp", "add_k_proj"],
                                                            "text_encoder": CLIP_ATTENTION}, seed=1),
        "b": make_adapter(FluxPipeline, src, folder / "b", {"transformer": ["ff.net.2", "norm1.linear", "proj_out"]},
                          seed=2, rank=2, alpha=2.0),
        "kohya": flux_original_adapter(src, FLUX_ORIGINAL, folder / "kohya.safetensors", seed=3),
        "comfy": flux_original_adapter(src, FLUX_ORIGINAL, folder / "comfy.safetensors", seed=3, comfy=True),
    }


@dataclass(frozen=True)
class TinyBuild:
    source: object  # export.source.ModelSource
    folder: Path  # holds onnx/ and ort-fp32/


@pytest.fixture(scope="session")
def sd3_tiny_build(tiny_source, tiny_build) -> TinyBuild:
    """sd3-tiny's source and build folder, as the U-Net families' builds come."""
    return TinyBuild(tiny_source, tiny_build)


def _tiny_build(shared_root: Path, source) -> TinyBuild:
    """`source` (a registry name or ModelSource) exported and built for ort-fp32 into the shared root,
    or found there up to date."""
    from engines.api import build_artifact
    from export.api import export_model
    from export.source import resolve

    source = resolve(source) if isinstance(source, str) else source
    folder = shared_root / source.entry.name
    export_model(source, folder, reuse_from=shared_root)  # the graphs of components other tiny models share
    build_artifact(folder, "ort", "fp32")
    return TinyBuild(source, folder)


TINY_VAE = "taesd3-tiny"  # sd3-tiny's random tiny autoencoder (export/families/tiny_vae.py)


def with_tiny_vae(build: TinyBuild, tiny: str) -> TinyBuild:
    """`build`'s model exported with the random AutoencoderTiny `tiny` beside its VAE and built for ort-fp32,
    beside `build` in the shared root (the bench's tiny-vae table builds the same folder)."""
    from bench.prepare import build_with_tiny_vae

    return TinyBuild(build.source, build_with_tiny_vae(build.source, build.folder, tiny))


@pytest.fixture(scope="session")
def sd3_tiny_vae_build(sd3_tiny_build) -> TinyBuild:
    """sd3-tiny exported with taesd3-tiny beside its VAE, built for ort-fp32 (the tiny-VAE tests and the
    bench smoke test share it)."""
    return with_tiny_vae(sd3_tiny_build, TINY_VAE)


def _tiny_build_fixture(name: str, shares_with: str | None):
    @pytest.fixture(scope="session")
    def build(shared_root, request):
        if shares_with:  # built first: this export links the graphs of the components they share
            request.getfixturevalue(f"{shares_with.replace('-', '_')}_build")
        return _tiny_build(shared_root, name)
    return build


# A session fixture per tiny model the tests build besides sd3-tiny (sd15_tiny_build, flux_fill_tiny_build,
# ...), and the model whose components (text encoders, VAE) it shares.
TINY_MODELS = {"sd15-tiny": None, "sd15-inpaint-tiny": "sd15-tiny", "sdxl-tiny": None, "flux-tiny": None,
               "flux-schnell-tiny": "flux-tiny", "flux-fill-tiny": "flux-tiny", "flux-control-tiny": "flux-tiny",
               "flux-kontext-tiny": "flux-tiny", "z-image-tiny": None, "flux2-klein-tiny": None,
               "flux2-klein-base-tiny": "flux2-klein-tiny", "flux2-dev-tiny": "flux2-klein-tiny",
               "flux2-klein-kv-tiny": "flux2-klein-tiny", "qwen-image-tiny": None,
               "qwen-image-edit-tiny": "qwen-image-tiny", "qwen-image-edit-plus-tiny": "qwen-image-edit-tiny",
               "qwen-image-edit-2511-tiny": "qwen-image-edit-tiny", "qwen-image-2.1-tiny": None,
               "wan-tiny": None, "wan22-tiny": "wan-tiny", "wan22-ti2v-tiny": "wan-tiny",
               "wan21-i2v-tiny": "wan-tiny", "wan22-i2v-tiny": "wan-tiny",
               "ltx-video-tiny": None}
for _name, _shares_with in TINY_MODELS.items():
    globals()[f"{_name.replace('-', '_').replace('.', '_')}_build"] = _tiny_build_fixture(_name, _shares_with)


def with_controlnets(shared_root: Path, build, controlnets: list[str], name: str) -> Path:
    """`build`'s export with `controlnets`, built for ort-fp32, in the shared root's folder `name`. Its other
    graphs are taken from the shared root's exports, as is any graph of the ControlNets another such folder
    holds (the ControlNet pipeline folder tests and the bench smoke then export nothing again)."""
    from engines.api import build_artifact
    from export.api import export_model

    folder = shared_root / name
    export_model(build.source, folder, controlnets=[str(controlnet_folder(n)) for n in controlnets],
                 reuse_from=shared_root)
    build_artifact(folder, "ort", "fp32")
    return folder


_FOLDERS = {}


def controlnet_folder(name: str):
    """A random test ControlNet's folder, resolved once: the export and the reference read the same one
    even when another change to the family code rebuilds the random models meanwhile."""
    from export.families.controlnet import folder_of

    if name not in _FOLDERS:
        _FOLDERS[name] = folder_of(name)
    return _FOLDERS[name]


def with_wan_prompt_cleaning() -> None:
    """diffusers' WanImageToVideoPipeline calls ftfy even where it is not installed (WanPipeline only where it is):
    it gets the text to video pipeline's cleaning, which it is without ftfy."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    pipeline_wan_i2v.prompt_clean = pipeline_wan.prompt_clean


def wan_image_to_video_pair(build: TinyBuild):
    """(our pipeline on the build's ort-fp32 artifact, diffusers' WanImageToVideoPipeline on its folder)."""
    from diffusers import WanImageToVideoPipeline

    from runners import Pipeline

    with_wan_prompt_cleaning()
    reference = WanImageToVideoPipeline.from_pretrained(build.source.folder)
    reference.set_progress_bar_config(disable=True)
    return Pipeline.load(build.folder / "ort-fp32"), reference


def cached_video_runs(ours, reference, request):
    """run(*args, **kwargs) -> (ours, diffusers') frames (N, F, H, W, 3) of the request `request(*args, **kwargs)`
    makes ((latents, call)), from the same latents; each request runs once."""
    import torch

    cache = {}

    def run(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in cache:
            latents, call = request(*args, **kwargs)
            with torch.no_grad():
                theirs = reference(latents=torch.from_numpy(latents), output_type="np", **call).frames
            cache[key] = ours(latents=latents, **call), theirs
        return cache[key]
    return run


def ours_and_diffusers(build: TinyBuild, pipeline_class: str):
    """(our pipeline on the build's ort-fp32 artifact, diffusers' `pipeline_class` on the same weights)."""
    import diffusers

    from runners import Pipeline

    reference = getattr(diffusers, pipeline_class).from_pretrained(build.source.folder)
    reference.set_progress_bar_config(disable=True)
    return Pipeline.load(build.folder / "ort-fp32"), reference


def manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def qwen_packed_noise(n: int, height: int, width: int, seed: int = 0):
    """Latents as the Qwen-Image pipelines take them: (n, tokens, 64), 2 x 2 patches of the 16-channel latents."""
    import numpy as np

    from runners.latents import LatentLayout

    noise = np.random.default_rng(seed).standard_normal((n, 16, height // 8, width // 8), dtype=np.float32)
    return LatentLayout(patch=2).pack(noise)


def paired_runs(pair, noise):
    """run(prompt, height=64, width=64, steps=3, per_prompt=1, **options) -> (ours, diffusers') images of one
    text-to-image request on `pair` (ours, the diffusers pipeline), both from the latents `noise(n, height,
    width)`; each request runs once."""
    import torch

    ours, reference = pair
    cache = {}

    def run(prompt, height=64, width=64, steps=3, per_prompt=1, **options):
        key = repr((prompt, height, width, steps, per_prompt, sorted(options.items())))
        if key not in cache:
            n = (len(prompt) if isinstance(prompt, list) else 1) * per_prompt
            latents = noise(n, height, width)
            common = dict(height=height, width=width, num_inference_steps=steps, output_type="np",
                          num_images_per_prompt=per_prompt)
            with torch.no_grad():  # diffusers templates a list of prompts in place (Z-Image's): it gets copies
                copies = {k: list(v) if isinstance(v, list) else v for k, v in dict(options, prompt=prompt).items()}
                theirs = reference(latents=torch.from_numpy(latents), **common, **copies).images
            cache[key] = (ours(prompt, latents=latents, **common, **options), theirs)
        return cache[key]
    return run


def two_prompt_images(noise, cfg: dict):
    """artifact -> its images of two 64x64 calls of 4 steps from the latents `noise(1, 64, 64, seed=1)`: a prompt
    alone, and another with the guidance options `cfg` (the images the target tests compare)."""
    def images(artifact):
        from runners import Pipeline

        pipe = Pipeline.load(artifact)
        latents = noise(1, 64, 64, seed=1)
        return [pipe(prompt, latents=latents, height=64, width=64, num_inference_steps=4, output_type="np",
                     **options) for prompt, options in (("a photo of a cat", {}), ("a red fox", cfg))]
    return images


def assert_case_equal(run_both, cases: dict, case: str, atol: float, label: str, least_change: float) -> None:
    """Case `case` of `cases` ({name: (arguments, the case whose image it must change, or None)}) run by
    `run_both(**arguments)` -> (ours, diffusers'): equal within `atol`, diffusers' a real image, and the case's
    feature changing our image by more than `least_change` from the case it names."""
    import numpy as np

    arguments, changes = cases[case]
    ours, theirs = run_both(**arguments)
    assert_real_image(theirs)
    assert ours.shape == theirs.shape
    error = float(np.abs(ours - theirs).max())
    print(f"{label} {case}: |ours - diffusers| {error:.1e}")
    assert error <= atol
    if changes:
        changed = float(np.abs(ours - run_both(**cases[changes][0])[0]).max())
        print(f"{label} {case}: changed the image by {changed:.4f}")
        assert changed > least_change


def assert_processor_patches_equal(folder, kind: str, patch: int, sizes) -> None:
    """runners/families/qwen_image_edit/vision.py's `pixel_patches` at `patch` pixels and the folder's pixel budget
    and normalisation against the folder's image processor (transformers' `kind` processor, PIL backend) on images
    of `sizes` ((width, height) each): pixel values and patch grids exactly."""
    import numpy as np
    from PIL import Image

    from export.families.qwen_image_edit import load_processor
    from runners.families.qwen_image_edit.vision import VisionConfig, pixel_patches

    processor = load_processor(folder, kind).image_processor
    config = VisionConfig(patch=patch, min_pixels=processor.size.shortest_edge, max_pixels=processor.size.longest_edge,
                          mean=tuple(processor.image_mean), std=tuple(processor.image_std))
    rng = np.random.default_rng(0)
    for width, height in sizes:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        theirs = processor(images=image, return_tensors="np")
        patches, grid = pixel_patches(image, config)
        assert [1, *grid] == theirs["image_grid_thw"][0].tolist()
        assert np.array_equal(patches, theirs["pixel_values"]), (width, height)


def assert_real_image(image, max_clipped: float = 0.25) -> None:
    """A compared image must carry information: at most `max_clipped` of its values saturated at 0
    or 1, and real variation. Two mostly-clipped images agree whatever the pipelines did. (The
    precision tests' sd3-tiny images have about 4% clipped and a std of 0.17.) Checking the
    reference is enough where the other image must agree with it to 1/255."""
    import numpy as np

    clipped = float(np.mean((image <= 0.0) | (image >= 1.0)))
    assert clipped <= max_clipped, f"{clipped:.0%} of the image's values are clipped at 0 or 1"
    assert image.std() > 0.05, f"image std {image.std():.3f}: nearly constant"


def assert_served_image(served, expected, what="") -> None:
    """A served 8-bit image is the in-process Pipeline's but for rounding: Triton's Python stub rounds a value
    at a level's edge the other way now and then (sd15-cn2 with scale 0.7: 1 value in 12,288, one level; the
    same call through runners.serving.requests in this process, on 1 or 2 threads, is exact). Another request's
    image differs by many levels in many values."""
    import numpy as np

    diff = np.abs(np.asarray(served, np.int16) - np.asarray(expected, np.int16))
    assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3, (what, int(diff.max()), float(np.mean(diff > 0)))


@contextmanager
def library_deep_cache(reference, interval: int):
    """The DeepCache library's own `DeepCacheSDHelper` at branch 0 on diffusers' pipeline `reference` (the
    reference of runners/caches/deep_cache.py). Yields a list that gains an item at each full step: the
    mid block runs only then."""
    from DeepCache import DeepCacheSDHelper

    helper = DeepCacheSDHelper(pipe=reference)
    helper.set_params(cache_interval=interval, cache_branch_id=0)
    helper.enable()
    key, full = ("mid", "mid_block", 0, 0), []
    mid_block = helper.function_dict[key]  # what the helper's wrapper calls when the step runs in full

    def counted(*args, **kwargs):
        full.append(1)
        return mid_block(*args, **kwargs)

    helper.function_dict[key] = counted
    try:
        yield full
    finally:
        helper.function_dict[key] = mid_block
        helper.disable()


def rtx_options(shared: Path | None = None, **kwargs):
    """TrtOptions for TensorRT-RTX: on a machine without a GPU the build needs the generations to
    target (it refuses to guess), SM89 here; with a GPU, the default is that GPU's. `shared`: a build
    folder in the session's shared root, whose engine cache is then the root's, every model's: an engine
    of a graph that tiny models share (Z-Image's VAE is FLUX.1's, Wan's variants share its text encoder)
    is built once (the cache is keyed by the graph's bytes and the settings)."""
    from engines.targets.trt import TrtOptions
    from runners.backends.trt import gpu_count

    if shared is not None:
        kwargs.setdefault("cache_dir", Path(shared).parent / "engine-cache")
    return TrtOptions(compute_capabilities=() if gpu_count() else ("SM89",), **kwargs)


def assert_targets_within(folder, images, bounds: dict, name: str) -> None:
    """Every target and precision of `bounds` ({label: each image's least PSNR}; "fp16" is ort's, "openvino-bf16-
    int4-weights" OpenVINO's with its weights option) built from the export in `folder`, calibrated on 4 prompts x 4
    steps (`FAMILY_TESTS_CALIBRATION`, which the family tables' bench smoke takes too): `images(artifact)` within
    their bounds against ort-fp32's, and finite."""
    import numpy as np

    from bench.accuracy import FAMILY_TESTS_CALIBRATION, psnr
    from engines.api import build_artifact
    from engines.targets import target_options

    reference = images(folder / "ort-fp32")
    for label, least in bounds.items():
        target, precision, *weights = label.split("-") if "-" in label else ("ort", label)
        options = target_options(target, weights=weights[0]) if weights else None
        artifact = build_artifact(folder, target, precision, options=options,
                                  calibration=FAMILY_TESTS_CALIBRATION)
        for ref, image, bound in zip(reference, images(artifact), least):
            print(f"{name} {label}: PSNR {psnr(ref, image):.1f} dB")
            assert np.isfinite(image).all() and psnr(ref, image) >= bound, (label, psnr(ref, image))


def assert_rtx_builds_every_submodule(folder, images, monkeypatch) -> None:
    """Real TensorRT-RTX fp16 engines for every submodule of the export in `folder`, the export's ranges as their
    profiles; `images(artifact)` on them through the GPU stand-in (tests/gpu_double.py) are ONNX Runtime's
    exactly. fp16's calibration is the target tests' (4 prompts x 4 steps: recorded once for both)."""
    import numpy as np

    from bench.accuracy import FAMILY_TESTS_CALIBRATION
    from engines.api import build_artifact
    from gpu_double import SharedBuffers

    built = build_artifact(folder, "trt-rtx", "fp16", options=rtx_options(folder),
                           calibration=FAMILY_TESTS_CALIBRATION)
    m = manifest(built)
    assert sorted(m["submodules"]) == sorted(manifest(folder / "onnx")["submodules"])
    for name, sub in m["submodules"].items():
        assert (built / sub["file"]).stat().st_size > 100_000, name  # a serialized engine, not a stub
        assert set(sub["engine"]["profile"]) == {t["name"] for t in sub["inputs"]}, name
    reference = images(folder / "ort-fp32")
    double = SharedBuffers.install(monkeypatch, folder / "ort-fp32")
    assert all(np.array_equal(a, b) for a, b in zip(images(built), reference))
    assert double.opened and all(s.profile for s in double.opened)


def smooth_image(height: int, width: int, seed: int = 0):
    """A smooth RGB picture (a random image would be mostly noise to the VAE)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phase = np.random.default_rng(seed).uniform(0, 6, 3)
    rgb = np.stack([0.5 + 0.45 * np.sin(6 * x + 4 * y + p) for p in phase], axis=-1)
    return Image.fromarray((rgb * 255).round().astype(np.uint8))


def soft_mask(height: int, width: int):
    """A soft-edged ellipse, white inside: binarized by the pipelines (white repaints)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    r = ((y - height * 0.45) / (height * 0.3)) ** 2 + ((x - width * 0.55) / (width * 0.35)) ** 2
    return Image.fromarray((np.clip(1.5 - r, 0, 1) * 255).round().astype(np.uint8), mode="L")


def image_task_outputs(pipe, height: int = 128, width: int = 128, steps: int = 6, **kwargs) -> dict[str, np.ndarray]:
    """Image to image and inpainting on `pipe`, from fixed inputs and noise: what a text-to-image run
    from fixed latents is to the comparison of two artifacts, for the image tasks (inpainting alone
    for an inpainting denoiser)."""
    rng = np.random.default_rng(7)
    shape = (1, pipe.manifest["constants"]["latent_channels"], height // 8, width // 8)
    noise, encoder_noise = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    common = dict(prompt="a photo of a cat", image=smooth_image(height, width), height=height, width=width,
                  noise=noise, encoder_noise=encoder_noise, num_inference_steps=steps, output_type="np", **kwargs)
    outputs = {} if pipe.inpainting_denoiser() else {"image to image": pipe(strength=0.6, **common)}
    return {**outputs, "inpainting": pipe(mask_image=soft_mask(height, width), strength=0.8, **common)}


def flux_packed_latents(n: int, height: int, width: int, seed: int) -> np.ndarray:
    """Packed starting latents, as FluxPipeline takes them: (n, tokens, 64)."""
    return np.random.default_rng(seed).standard_normal((n, (height // 16) * (width // 16), 64), dtype=np.float32)


def compare_flux_image_task(monkeypatch, ours, reference, case: str, request: dict):
    """Image to image or inpainting (`reference`'s task) on our pipeline and diffusers', diffusers' randn_tensor
    patched: the pipeline's noise and the VAE's posterior samples are ours."""
    import importlib

    import torch

    import diffusers.models.autoencoders.vae as diffusers_vae

    name = type(reference).__name__
    request = dict(request, prompt="a photo of a cat", num_inference_steps=4, max_sequence_length=16)
    height, width, n = request["height"], request["width"], request.get("num_images_per_prompt", 1)
    rng = np.random.default_rng(len(case))
    encoder_noise, noise = (rng.standard_normal((k, 16, height // 8, width // 8), dtype=np.float32) for k in (1, n))
    module = importlib.import_module(f"diffusers.pipelines.flux.pipeline_flux_{name[4:-8].lower()}")
    monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(encoder_noise))
    monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: torch.from_numpy(noise))
    images = dict(image=smooth_image(height + 13, width - 7, seed=len(case)))  # resized to the size asked for
    if name != "FluxImg2ImgPipeline":
        images["mask_image"] = soft_mask(height + 13, width - 7)
    ref = reference(output_type="np", **images, **request).images
    got = ours(noise=noise, encoder_noise=encoder_noise, output_type="np", **images, **request)
    assert got.shape == ref.shape == (n, height, width, 3)
    print(f"{case}: max abs error {np.abs(got - ref).max():.1e}")
    assert np.abs(got - ref).max() <= 1 / 255
    assert_real_image(ref)


def edge_image(height: int, width: int, seed: int):
    """A canny-like control image: thin white curves on black."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    field = np.sin(rng.uniform(6, 14) * x + rng.uniform(0, 6)) * np.sin(rng.uniform(6, 14) * y + rng.uniform(0, 6))
    edges = ((np.abs(field) < 0.1) * 255).astype(np.uint8)
    return Image.fromarray(np.repeat(edges[..., None], 3, axis=-1))


def compare_controlled(ours, ref, unused) -> float:
    """Our image against diffusers' within 1/255; diffusers' without the control (`unused`) differs."""
    assert ours.shape == ref.shape
    err = float(np.abs(ours - ref).max())
    print(f"max abs error {err:.1e}, the control's effect {np.abs(ref - unused).max():.3f}")
    assert err <= 1 / 255, err
    assert np.abs(ref - unused).max() > 10 * 1 / 255, "the ControlNet changed nothing: the test would prove nothing"
    assert_real_image(ref)
    return err


def assert_calls_keep_apart(pipe, calls: list[dict]) -> None:
    """Each call's conditions are its own (runners/call.py): two `calls` (keyword dicts) on `pipe` in two
    threads, held together at their first denoiser call so that each has made its conditions before the
    other denoises, give each the latents it gives alone; the two differ, so this fails if either call saw
    the other's conditions."""
    import threading

    calls = [dict(call, output_type="latent") for call in calls]
    alone = [pipe(**call) for call in calls]
    assert np.abs(alone[0] - alone[1]).max() > 1e-3
    together, errors, first, started = [None, None], [], threading.Barrier(2, timeout=120), set()

    def hold(submodule, feeds):  # each thread's first denoiser call waits for the other's
        if submodule == pipe.constants["denoiser"] and threading.get_ident() not in started:
            started.add(threading.get_ident())
            first.wait()

    def run(k):
        try:
            together[k] = pipe(**calls[k])
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    pipe.recorder = hold
    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        pipe.recorder = None
    assert not errors, errors
    for got, expected in zip(together, alone):
        assert np.abs(got - expected).max() <= 1e-6


def diffusers_schedule(config, steps: int) -> list[bool]:
    """Full (True) or cached per step by diffusers' TaylorSeer rule for our `config`, written out as the oracle."""
    before, after = config.disable_cache_before_step, config.disable_cache_after_step
    after = after + steps if after is not None and after < 0 else after
    return [s < before or (s - before - 1) % config.cache_interval == 0 or (after is not None and s >= after)
            for s in range(steps)]


@contextmanager
def diffusers_cache_hooks(transformer, apply, hooks: tuple[str, ...]):
    """diffusers' cache hooks put on `transformer` by `apply(transformer)` and named `hooks` (removed after),
    yielding the list of its calls. Each call runs in the cache context the pipeline names (QwenImagePipeline's
    "cond" and "uncond"), else in "cond" (SD3's and Z-Image's pipelines name none), and the state is reset after the
    run, as CacheMixin and the pipelines do."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    apply(transformer)
    calls, named = [], []
    forward = transformer.forward
    if hasattr(transformer, "cache_context"):
        pipelines_context = transformer.cache_context

        @contextmanager
        def naming(name, **kwargs):
            named.append(name)
            try:
                with pipelines_context(name, **kwargs):
                    yield
            finally:
                named.pop()

        transformer.cache_context = naming

    def in_context(*args, **kwargs):
        calls.append(1)
        _set_cache_context(transformer, CacheContext(named[-1] if named else "cond"))
        try:
            return forward(*args, **kwargs)
        finally:
            _set_cache_context(transformer, None)

    transformer.forward = in_context
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.invalidate_child_registries_cache()  # the hooks just added are among them (the pipeline is the session's)
    try:
        yield calls
    finally:
        del transformer.forward  # the class's own again
        transformer.__dict__.pop("cache_context", None)
        for hook in hooks:
            registry.remove_hook(hook, recurse=True)
        registry.invalidate_child_registries_cache()


@contextmanager
def diffusers_fbc_decisions():
    """diffusers' First-Block Cache decisions in call order (True: the remaining blocks ran)."""
    from diffusers.hooks import first_block_cache

    hook, seen = first_block_cache.FBCHeadBlockHook, []
    decide = hook._should_compute_remaining_blocks

    def spy(self, residual):
        seen.append(decide(self, residual))
        return seen[-1]

    hook._should_compute_remaining_blocks = spy
    try:
        yield seen
    finally:
        hook._should_compute_remaining_blocks = decide


@contextmanager
def diffusers_cache_hooks_on_each(pipeline, apply, hooks: tuple[str, ...]):
    """`diffusers_cache_hooks` on each transformer of `pipeline` (Wan 2.2 A14B's `transformer_2` too: a state of
    its own), yielding the list of their calls."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        calls = [stack.enter_context(diffusers_cache_hooks(t, apply, hooks))
                 for t in (pipeline.transformer, getattr(pipeline, "transformer_2", None)) if t is not None]
        yield calls


def with_diffusers_first_block_cache(reference_pipeline, threshold: float, **call):
    """(images, decisions) of diffusers' `reference_pipeline` called with `call` under `apply_first_block_cache`
    on each transformer (one context per call)."""
    import torch
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    apply = lambda transformer: apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))  # noqa: E731
    with diffusers_cache_hooks_on_each(reference_pipeline, apply, ("fbc_leader_block_hook", "fbc_block_hook")), \
            diffusers_fbc_decisions() as seen, torch.no_grad():
        return reference_pipeline(**call)[0], seen


def first_block_cache_against_diffusers(pair, threshold: float, latents, name: str, contexts=("batch",),
                                        **call) -> tuple[float, float]:
    """(|ours - diffusers|, how much the cache changed our image) of First-Block Cache at `threshold` on `pair`
    (our pipeline, diffusers') called with `call` from the same `latents`: the decisions step by step must be
    diffusers', who decides for the cache `contexts` in that order at each step (one, "batch", where guidance is
    one batched call; QwenImagePipeline's "cond" then "uncond"); the reference image must be a real one."""
    import torch

    from runners import FirstBlockCacheConfig

    ours, reference = pair
    theirs, decisions = with_diffusers_first_block_cache(reference, threshold, latents=torch.from_numpy(latents),
                                                         **call)
    cached = ours(latents=latents, cache=FirstBlockCacheConfig(threshold), **call)
    stats = ours.cache_stats
    error, changed = float(np.abs(cached - theirs).max()), float(np.abs(cached - ours(latents=latents, **call)).max())
    print(f"{name} threshold {threshold}: diffusers {decisions}; ours {stats['full']} full, {stats['cached']} cached; "
          f"|ours - diffusers| {error:.1e}, the cache changed the image by {changed:.3f}")
    ours_in_order = [stats["decisions"][c][step] for step in range(len(decisions) // len(contexts)) for c in contexts]
    assert ours_in_order == decisions
    assert_real_image(theirs)
    return error, changed


def with_diffusers_taylorseer(reference_pipeline, config, module: str, **call):
    """(images, transformer calls) of diffusers' `reference_pipeline` called with `call` under its TaylorSeer hook
    on each transformer's output layer `module` (lite mode's cached module; the blocks still run and their work
    is thrown away: the image is lite mode's)."""
    import torch
    from diffusers.hooks import TaylorSeerCacheConfig as Reference, apply_taylorseer_cache

    reference = Reference(
        cache_interval=config.cache_interval, disable_cache_before_step=config.disable_cache_before_step,
        disable_cache_after_step=config.disable_cache_after_step, max_order=config.max_order,
        taylor_factors_dtype=torch.float32, cache_identifiers=[f"^{re.escape(module)}$"])
    with diffusers_cache_hooks_on_each(reference_pipeline, lambda t: apply_taylorseer_cache(t, reference),
                                       ("taylorseer_cache",)) as calls, torch.no_grad():
        return reference_pipeline(**call)[0], sum(map(len, calls))


def server_for(repository: Path, **kwargs):
    """A tritonserver for `repository` on free ports of 127.0.0.1 (a context manager: stopped on exit)."""
    from runners.serving.server import Server, free_ports

    http, grpc, metrics = free_ports(3)
    # A client's idle keep-alive connection holds Triton's exit for the whole exit timeout: keep it short.
    return Server(repository, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout=2, **kwargs)
