"""python -m runners ARTIFACT --prompt "..." --out out.png: text to image from an artifact folder;
with --image IN.png [--strength S], image to image; with --mask MASK.png too, inpainting.
python -m runners triton ARTIFACT --out REPO and python -m runners serve ARTIFACT: Triton serving
(runners/serving/cli.py)."""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path


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


def _check_out(out: str) -> None:
    """Before any engine runs: an --out whose extension names no format Pillow writes."""
    from PIL import Image

    suffix = Path(out).suffix.lower()
    if Image.registered_extensions().get(suffix) not in Image.SAVE:
        raise ValueError(f"--out {out}: Pillow writes no image format with the extension {suffix or '(none)'!r}; "
                         "use .png, .jpg or .webp")


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


CONTROL_OPTIONS = {"control_image": "--control-image/--canny", "controlnet_conditioning_scale": "--control-scale",
                   "control_guidance_start": "--control-start", "control_guidance_end": "--control-end",
                   "guess_mode": "--guess-mode", "control_mode": "--control-mode"}  # the call's argument each sets


def _control_arguments(args) -> dict:
    """The ControlNet arguments of a call from the CLI's (those not given left out)."""
    from runners.conditioning.controlnet import canny_edges

    images = [_read_image(path, "--control-image") for path in args.control_image]
    if args.canny:
        low, high = _thresholds(args.canny_thresholds)
        images += [canny_edges(_read_image(path, "--canny"), low, high) for path in args.canny]
    scales = args.control_scale
    control = {"control_image": images if len(images) > 1 else images[0] if images else None,
               "controlnet_conditioning_scale": scales if len(scales) > 1 else scales[0] if scales else None,
               "control_guidance_start": args.control_start, "control_guidance_end": args.control_end,
               "guess_mode": True if args.guess_mode else None,
               "control_mode": args.control_mode if len(args.control_mode) > 1 else
               args.control_mode[0] if args.control_mode else None}
    return {k: v for k, v in control.items() if v is not None}


def _thresholds(text: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--canny-thresholds {text}: give LOW,HIGH, two numbers such as 100,200") from None
    return low, high


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("triton", "serve"):  # python -m runners triton|serve ARTIFACT ...
        from runners.serving.cli import COMMANDS

        return COMMANDS[argv[0]](argv[1:])
    p = argparse.ArgumentParser(prog="python -m runners", description=__doc__)
    p.add_argument("artifact", help="an artifact folder, e.g. build/sd3-tiny/ort-fp32")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--height", type=int, default=None,
                   help="default: the artifact's opt size (SD1.5's and SDXL's image to image: the image's own)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--steps", type=int, default=None,
                   help="default: diffusers' for the family and task (SD3 28, with an image 50; SD1.5 and SDXL 50; "
                        "Flux dev 28, schnell 4)")
    p.add_argument("--guidance", type=float, default=None,
                   help="default: diffusers' for the family and task (SD3 7, SD1.5 7.5, SDXL 5 and 7.5 inpainting; "
                        "Flux dev 3.5, its guidance embedding, and with an image 7; schnell has none)")
    p.add_argument("--true-cfg-scale", type=float, default=None,
                   help="Flux: classifier-free guidance with --negative-prompt, as diffusers' true_cfg_scale "
                        "(default 1: none; the negative prompt does nothing without a scale over 1)")
    p.add_argument("--seed", type=int, default=0, help="numpy's generator (not torch's noise)")
    p.add_argument("--num-images", type=int, default=1)
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="T5 tokens (default: SD3 256, Flux dev 512, Flux schnell 256)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vae-tiling", action="store_true",
                   help="decode in overlapping tiles even when the image fits the VAE engine (it is automatic "
                        "when the image is larger than the engine's range)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="write a Chrome trace per engine call, one of the whole run (DIR/trace.json, opens in "
                        "Perfetto) and a summary; --steps 1 makes a quick profile")
    p.add_argument("--device-map", default="", metavar="SUB=GPU,...",
                   help="TensorRT artifacts: put submodules on GPUs, e.g. text_encoder_3=1 (the rest on GPU 0)")
    p.add_argument("--image", type=Path, default=None, metavar="IN.png",
                   help="image to image: start from this image (its size, or the model's for SD3, unless "
                        "--height/--width are given)")
    p.add_argument("--mask", type=Path, default=None, metavar="MASK.png",
                   help="with --image: inpainting, repaint the mask's white part (a mask of the image's size); "
                        "with --control-image alone, SD3's inpainting ControlNets' mask")
    p.add_argument("--strength", type=float, default=None,
                   help="with --image: how much to change it, in (0, 1] (default: diffusers', SD3 0.6, SD1.5 0.8 and "
                        "inpainting 1, SDXL 0.3 and inpainting 0.9999, Flux 0.6)")
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
    p.add_argument("--control-image", type=Path, action="append", default=[], metavar="IN.png",
                   help="ControlNet: the next ControlNet's control image (repeat: one per ControlNet of the artifact, "
                        "in the order controlnet, controlnet_1, ...); its size is the image's unless --height/--width")
    p.add_argument("--canny", type=Path, action="append", default=[], metavar="IN.png",
                   help="ControlNet: IN.png's canny edge map (OpenCV) as the next control image, after those of "
                        "--control-image; needs the canny extra (pip install 'diffusion-aot[canny]')")
    p.add_argument("--canny-thresholds", default="100,200", metavar="LOW,HIGH",
                   help="the canny map's hysteresis thresholds (default 100,200)")
    p.add_argument("--control-scale", type=float, action="append", default=[], metavar="S",
                   help="controlnet_conditioning_scale: one for every ControlNet, or one per ControlNet (default 1)")
    p.add_argument("--control-start", type=float, default=None, metavar="F",
                   help="the ControlNets act from this fraction of the steps (default 0)")
    p.add_argument("--control-end", type=float, default=None, metavar="F",
                   help="... up to this fraction of the steps (default 1)")
    p.add_argument("--control-mode", type=int, action="append", default=[], metavar="M",
                   help="a Flux ControlNet-Union's control mode (the kind of control image: its model card lists "
                        "them): one for every ControlNet, or one per ControlNet")
    p.add_argument("--guess-mode", action="store_true",
                   help="ControlNet guess mode: the ControlNets see the conditional half of guidance only")
    p.add_argument("--out", default="out.png", help="PNG path; with several images, _0, _1 ... are added")
    args = p.parse_args(argv)

    from runners import Pipeline
    from runners.caches import parse_cache
    from runners.cli import run_cli
    from runners.adapters.lora import parse_lora_spec
    from runners.pipeline import parse_device_map
    from runners.manifest import ManifestError

    def generate():
        _check_out(args.out)
        if args.mask and not (args.image or args.control_image or args.canny):
            raise ValueError("--mask needs --image: inpainting repaints the mask's white part of an image (or, "
                             "for SD3's inpainting ControlNets, --control-image)")
        image = _read_image(args.image, "--image") if args.image else None
        mask = _read_image(args.mask, "--mask") if args.mask else None
        t0 = time.perf_counter()
        cache = parse_cache(args.cache) if args.cache else None
        loras = dict(parse_lora_spec(spec) for spec in args.lora)
        pipe = Pipeline.load(args.artifact, threads=args.threads, progress=True,
                             device_map=parse_device_map(args.device_map), vae="tiny" if args.tiny_vae else "full",
                             loras=loras)
        pipe.enable_cache(cache)
        previews = {} if args.preview_dir is None else {
            "preview_every": args.preview_every,
            "on_preview": lambda step, images: _save_all(images, _numbered(args.preview_dir / f"step_{step:03d}.png",
                                                                          len(images)))}
        timings = {"load": time.perf_counter() - t0}
        if args.true_cfg_scale is not None and "true_cfg_scale" not in inspect.signature(pipe.generate).parameters:
            raise ValueError(f"--true-cfg-scale is Flux's (classifier-free guidance with a negative prompt); this "
                             f"artifact is {pipe.family}'s, whose guidance is --guidance")
        control = _control_arguments(args)
        refused = [CONTROL_OPTIONS[k] for k in control if k not in inspect.signature(pipe.generate).parameters]
        if refused:
            raise ValueError(f"{', '.join(refused)}: this artifact ({pipe.family}) does not take them (the U-Net "
                             "families' ControlNets take every --control-* option but --control-mode; SD3's all but "
                             "--guess-mode and --control-mode; Flux's all but --guess-mode; FLUX.1 Canny/Depth "
                             "--control-image or --canny)")
        given = {**control, "num_inference_steps": args.steps, "guidance_scale": args.guidance,
                 "max_sequence_length": args.max_sequence_length, "image": image, "mask_image": mask,
                 "strength": args.strength, "true_cfg_scale": args.true_cfg_scale}  # unset: the family's defaults
        images = pipe(args.prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                      seed=args.seed, num_images_per_prompt=args.num_images,
                      vae_tiling=True if args.vae_tiling else None, profile=args.profile, **previews,
                      **{k: v for k, v in given.items() if v is not None})
        timings.update(pipe.timings)
        paths = _numbered(Path(args.out), len(images))
        _save_all(images, paths)
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())
        stats = pipe.cache_stats
        evaluated = f"; denoiser {stats['full']} full, {stats['cached']} cached" if stats.get("cached") else ""
        print(f"{stages}{evaluated}; wrote {', '.join(map(str, paths))}")

    return run_cli(generate, (ManifestError, ValueError, RuntimeError), "no image was written")


if __name__ == "__main__":
    sys.exit(main())
