"""python -m runners ARTIFACT --prompt "..." --out out.png: text to image from an artifact folder;
with --image IN.png [--strength S], image to image; with --mask MASK.png too, inpainting.
python -m runners triton ARTIFACT --out REPO and python -m runners serve ARTIFACT: Triton serving;
python -m runners openai ARTIFACT: an OpenAI-compatible images API (runners/serving/cli.py)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from runners.video import VIDEO_SUFFIXES, write_video


def _read_image(path: Path, option: str):
    """An --image or --mask file, read whole now, so that a missing or unreadable file is one line."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return image
    except FileNotFoundError:
        raise ValueError(f"{option} {path} does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{option} {path} is not an image file Pillow can read ({type(e).__name__})") from None


def _check_out(out: str, video: bool) -> None:
    """Before any engine runs: an --out an image (or, for a video model, a video) cannot be written to: an image
    format Pillow writes; a video's .mp4, or a folder for its frames as PNGs."""
    from PIL import Image

    suffix = Path(out).suffix.lower()
    if video:
        if suffix and suffix not in VIDEO_SUFFIXES:
            raise ValueError(f"--out {out}: this artifact makes videos; use a .mp4 path, or a folder (no extension) "
                             "for its frames as PNGs")
    elif Image.registered_extensions().get(suffix) not in Image.SAVE:
        hint = "; this artifact makes images" if suffix in VIDEO_SUFFIXES else ""
        raise ValueError(f"--out {out}: Pillow writes no image format with the extension {suffix or '(none)'!r}"
                         f"{hint}; use .png, .jpg or .webp")


def _save_all(images, paths: list[Path]) -> None:
    """All the images or none: each is written beside its path, and renamed once all are written."""
    temps = [path.with_name(f".{path.name}.partial{path.suffix}") for path in paths]
    try:
        for image, temp in zip(images, temps):
            temp.parent.mkdir(parents=True, exist_ok=True)
            image.save(temp)
        for temp, path in zip(temps, paths):
            temp.replace(path)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def _numbered(path: Path, count: int) -> list[Path]:
    """`path` for one image; path_0, path_1 ... for several."""
    return [path] if count == 1 else [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(count)]


def all_options() -> list:
    """Every family's declared request options that a command line takes, each name once: repeatable where
    any family repeats it (FLUX.2's reference images; one value still passes as itself)."""
    import dataclasses

    from runners.options import options
    from runners.pipeline import FAMILIES

    declarations = [o for cls in FAMILIES.values() for o in cls.options]
    repeated = {o.name for o in declarations if o.repeat}
    return [dataclasses.replace(o, repeat=o.name in repeated) for o in options(declarations) if o.cli]


def _cli_kind(option) -> dict:
    """argparse's settings for an option of its kind: unset is None (the family's default), a repeated
    flag collects a list, an image is a file read when the request is made."""
    if option.kind == "bool":
        return {"action": argparse.BooleanOptionalAction if option.default else "store_true", "default": None}
    metavar = option.cli_flag[2:].upper().replace("-", "_")
    kind = {"text": {"type": str, "metavar": metavar}, "int": {"type": int, "metavar": metavar},
            "float": {"type": float, "metavar": metavar}, "image": {"type": Path, "metavar": "IN.png"},
            "mask": {"type": Path, "metavar": "MASK.png"}}[option.kind]
    if option.repeat:
        return {**kind, "action": "append", "default": []}
    return {**kind, "default": None, **({"required": True} if option.name == "prompt" else {})}


def _request(args) -> dict:
    """The call's keyword arguments from the command line: the options given (images read now, so that a
    bad file is one line before any engine loads; one value of a repeated flag as itself), and --canny's
    edge maps after --control-image's. The seed defaults to 0, so that a command repeats its image."""
    request = {}
    for option in all_options():
        value = getattr(args, option.name)
        if option.kind in ("image", "mask"):
            value = [_read_image(path, option.cli_flag) for path in value] if option.repeat else \
                _read_image(value, option.cli_flag) if value is not None else None
        if option.name == "control_image" and args.canny:
            from runners.conditioning.controlnet import canny_edges

            low, high = _thresholds(args.canny_thresholds)
            value = value + [canny_edges(_read_image(path, "--canny"), low, high) for path in args.canny]
        if option.repeat:
            value = value[0] if len(value) == 1 else value or None
        if value is not None:
            request[option.name] = value
    return {"seed": 0, **request}


def _refuse_undeclared(pipe, request: dict) -> None:
    """An option the artifact's family does not declare is refused in one line saying whose it is."""
    from runners.options import declared
    from runners.pipeline import FAMILIES

    known = declared(pipe)
    for name in request:
        if name not in known:
            owners = sorted(f for f, cls in FAMILIES.items() if name in declared(cls))  # not import order
            option = declared(FAMILIES[owners[0]])[name]  # the first's words (a family may say its defaults)
            flag = "--control-image/--canny" if name == "control_image" else option.cli_flag
            named = ", ".join(owners[:-1]) + f" and {owners[-1]}" if len(owners) > 1 else owners[0]
            raise ValueError(f"{flag} is {named}'s ({option.help}); this artifact is {pipe.family}'s")


def _thresholds(text: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--canny-thresholds {text}: give LOW,HIGH, two numbers such as 100,200") from None
    return low, high


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("triton", "serve", "openai"):  # python -m runners triton|serve|openai ARTIFACT ...
        from runners.serving.cli import COMMANDS

        return COMMANDS[argv[0]](argv[1:])
    p = argparse.ArgumentParser(prog="python -m runners", description=__doc__)
    p.add_argument("artifact", help="an artifact folder, e.g. build/sd3-tiny/ort-fp32")
    # The request's options, as the families declare them (runners/options.py): every family's, so that a
    # flag another family takes is refused in one line naming whose it is, after the artifact is read.
    for option in all_options():
        p.add_argument(option.cli_flag, dest=option.name, help=option.help, **_cli_kind(option))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="write a Chrome trace per engine call, one of the whole run (DIR/trace.json, opens in "
                        "Perfetto) and a summary; --steps 1 makes a quick profile")
    p.add_argument("--device-map", default="", metavar="SUB=GPU,...",
                   help="TensorRT artifacts: put submodules on GPUs, e.g. text_encoder_3=1 (the rest on GPU 0)")
    p.add_argument("--cache", default=None, metavar="KIND[:KEY=VALUE,...]",
                   help="skip denoiser evaluations: taylorseer[:interval=5,before=3,after=None,order=1] (diffusers' "
                        "TaylorSeer lite and its defaults; openvino.genai's: taylorseer:interval=3,before=6,after=-2), "
                        "first-block[:THRESHOLD] (First-Block Cache, SD3 and Flux; default 0.05), or "
                        "deepcache[:INTERVAL] (DeepCache, SD1.5 and SDXL; default 3)")
    p.add_argument("--tiny-vae", action="store_true",
                   help="decode (and encode) with the tiny autoencoder the artifact carries (export --tiny-vae)")
    p.add_argument("--preview-dir", type=Path, default=None, metavar="DIR",
                   help="write the current estimate as DIR/step_NNN[_i].png every --preview-every steps (the tiny "
                        "decoder's, or a latent-to-RGB projection)")
    p.add_argument("--preview-every", type=int, default=1, metavar="N")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                   help="apply a LoRA adapter .safetensors (diffusers/PEFT or kohya) at SCALE (default 1) for this "
                        "run; repeatable (docs/lora.md)")
    p.add_argument("--canny", type=Path, action="append", default=[], metavar="IN.png",
                   help="ControlNet: IN.png's canny edge map (OpenCV) as the next control image, after those of "
                        "--control-image; needs the canny extra (pip install 'diffusion-aot[canny]')")
    p.add_argument("--canny-thresholds", default="100,200", metavar="LOW,HIGH",
                   help="the canny map's hysteresis thresholds (default 100,200)")
    p.add_argument("--out", default="out.png", help="PNG path; with several images, _0, _1 ... are added; a video "
                        "model's: a .mp4 path (H.264) or a folder for its frames as PNGs")
    args = p.parse_args(argv)

    from runners import Pipeline
    from runners.caches import parse_cache
    from runners.cli import run_cli
    from runners.adapters.lora import parse_lora_spec
    from runners.pipeline import parse_device_map
    from runners.manifest import ManifestError

    def generate():
        if Path(args.out).suffix.lower() not in VIDEO_SUFFIXES:  # a video's is checked once the artifact is read
            _check_out(args.out, video=not Path(args.out).suffix)
        if args.mask_image and not (args.image or args.control_image or args.canny):
            raise ValueError("--mask needs --image: inpainting repaints the mask's white part of an image (or, "
                             "for SD3's inpainting ControlNets, --control-image)")
        t0 = time.perf_counter()
        cache = parse_cache(args.cache) if args.cache else None
        loras = dict(parse_lora_spec(spec) for spec in args.lora)
        request = _request(args)
        pipe = Pipeline.load(args.artifact, threads=args.threads, progress=True,
                             device_map=parse_device_map(args.device_map), vae="tiny" if args.tiny_vae else "full",
                             loras=loras)
        _refuse_undeclared(pipe, request)
        _check_out(args.out, pipe.layout.video)
        pipe.enable_cache(cache)
        previews = {} if args.preview_dir is None else {
            "preview_every": args.preview_every,
            "on_preview": lambda step, images: _save_all(images, _numbered(args.preview_dir / f"step_{step:03d}.png",
                                                                          len(images)))}
        timings = {"load": time.perf_counter() - t0}
        outputs = pipe(profile=args.profile, **previews, **request)
        timings.update(pipe.timings)
        paths = _numbered(Path(args.out), len(outputs))
        if pipe.layout.video:  # each video's frames (F, H, W, 3): an mp4 or a folder of PNGs, each written whole
            fps = request.get("frame_rate") or pipe.constants["fps"]  # LTX-Video's frame_rate, as the model is told
            for frames, path in zip(outputs, paths):
                write_video(frames, path, fps)
        else:
            _save_all(outputs, paths)
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())
        stats = pipe.cache_stats
        evaluated = f"; denoiser {stats['full']} full, {stats['cached']} cached" if stats.get("cached") else ""
        print(f"{stages}{evaluated}; wrote {', '.join(map(str, paths))}")

    return run_cli(generate, (ManifestError, ValueError, RuntimeError), "no image was written")


if __name__ == "__main__":
    sys.exit(main())
