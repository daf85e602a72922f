"""python -m export MODEL --out build/<name>: every submodule to ONNX, checked against PyTorch."""
from __future__ import annotations

import argparse
import sys

from export.onnx_export import DEFAULT_OPSET, EXPORT_DTYPES
from export.registry import MODELS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    p.add_argument("model", help=f"a registry name ({', '.join(MODELS)}) or a diffusers pipeline folder")
    p.add_argument("--out", required=True, help="build folder; graphs go to OUT/onnx")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    p.add_argument("--image-size", default=None, metavar="MIN,OPT,MAX",
                   help="image side range in pixels the engines are built for (default: the model's entry)")
    p.add_argument("--frames", default=None, metavar="MIN,OPT,MAX",
                   help="a video model's frame range the engines are built for, each 4k + 1 (default: the model's "
                        "entry; Wan's 5,81,81)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default=None,
                   help="weights and computation of the graphs (default: the model's entry; float32 for most); "
                        "float16 halves the memory the export needs and builds fp16 engines only")
    p.add_argument("--force", action="store_true",
                   help="re-export even if OUT/onnx is up to date, tracing every graph anew (no earlier "
                        "export's trace)")
    p.add_argument("--tiny-vae", default=None, metavar="FOLDER_OR_HUB_ID",
                   help="also export this AutoencoderTiny (madebyollin/taesd, taesdxl, taesd3, taef1; or a random "
                        "test one: taesd-tiny, taesdxl-tiny, taesd3-tiny, taef1-tiny) as vae_decoder_tiny and "
                        "vae_encoder_tiny: the runner's vae='tiny' and its live previews use it")
    p.add_argument("--controlnet", action="append", default=[], metavar="FOLDER_OR_HUB_ID",
                   help="also export this ControlNetModel (a folder, a hub id such as lllyasviel/sd-controlnet-canny, "
                        "or a random one: sd15-controlnet-tiny, sdxl-controlnet-tiny, sd3-controlnet-tiny, "
                        "flux-controlnet-tiny, sd15-bench-controlnet) as engine controlnet, "
                        "controlnet_1, ... (repeat for several); the submodules already exported are kept as they are")
    p.add_argument("--reuse-from", default=None, metavar="FOLDER",
                   help="a folder of other models' builds (FOLDER/*/onnx): a graph of the same component, exported "
                        "with the same settings, is linked from there instead of exported again (FLUX.1 Fill's text "
                        "encoders and VAE, after FLUX.1 dev's)")
    args = p.parse_args(argv)

    from export.api import export_model
    from export.source import SourceError
    from runners.cli import run_cli

    sizes = args.image_size.split(",") if args.image_size else None
    return run_cli(lambda: export_model(args.model, args.out, opset=args.opset, force=args.force, image_size=sizes,
                                                 dtype=args.dtype, tiny_vae=args.tiny_vae,
                                                 controlnets=args.controlnet, reuse_from=args.reuse_from,
                                                 frames=args.frames.split(",") if args.frames else None),
                   (SourceError, ValueError), "nothing was written")


if __name__ == "__main__":
    sys.exit(main())
