"""Peak memory and time of the VAE decode, whole and tiled, each in a fresh process."""
from __future__ import annotations

from bench.harness import Variant, interleaved_fresh, log
from bench.tables import Table
from runners.manifest import read_manifest


def measure(run) -> list[dict]:
    artifact = run.default_artifact
    vae = Variant("vae_decoder", "vae-decoder", str(artifact))
    scale = run.constants["vae_scale_factor"]
    hi = read_manifest(artifact, verify=False)["submodules"]["vae_decoder"]["dims"]["latent_height"][2]
    rows = []
    for size in (int(s) for s in run.args.tiling_sizes.split(",")):
        # Tiles of half the engine's largest side when the image fits it whole, else the largest side.
        tile = hi // 2 if size // scale <= hi else hi
        for tiling in (False, True):
            job = {"job": "vae_decode", "height": size, "width": size, "tiling": tiling, "tile": tile}
            samples, peaks, failed = interleaved_fresh([vae], run.constants, job, 1, log)
            label = f"tiled, {tile * scale}-px tiles" if tiling else "whole"
            if failed:
                rows.append([f"{size}x{size}", label, "failed", failed[vae.label].split(": ", 1)[1]])
            else:
                rows.append([f"{size}x{size}", label, f"{samples[vae.label][0]['seconds']:.1f}",
                             f"{peaks[vae.label]:.0f}"])
    return [{
        "title": f"VAE decode, whole and tiled ({artifact.name})",
        "columns": ["image", "decode", "seconds", "peak RSS MiB"], "rows": rows,
        "notes": [f"The decoder engine was built for latents up to {hi} ({hi * scale} px). One run each, every "
                  "one in a fresh process that loads only the VAE decoder (`Pipeline.load(..., "
                  "submodules=['vae_decoder'])`): peak RSS is that process's. A whole decode past that range "
                  "calls the engine directly (the runner would tile it): ONNX Runtime accepts any size, so this "
                  "row shows what decoding it whole would take."]}]


def _arguments(group) -> None:
    group.add_argument("--tiling-sizes", default="1024,2048", help="image sides of the tiled-decode table")


TABLE = Table("tiling", "VAE decode, whole and tiled", "nothing", ("sd3", "sd15", "sdxl"), measure, _arguments,
              smoke=("--tiling-sizes", "128,1024"))
