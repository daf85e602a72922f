"""The VAE decode of a video by frame count (issue 58's memory goal): seconds and the process's peak RSS at each of
--wan-vae-frames, ours (the chunk graphs of the ort-fp32 artifact, a latent frame a call) against diffusers'
AutoencoderKLWan, each run in a fresh process."""
from __future__ import annotations

import statistics

from bench.harness import Variant, interleaved_fresh, log
from bench.tables import Table
from bench.tables.family_table import _sides


def _measure(run) -> list[dict]:
    a = run.args
    height, width = _sides(a.wan_vae_size)
    variants = [Variant("(a) diffusers AutoencoderKLWan.decode, eager fp32", "wan-vae-diffusers", str(run.src.folder)),
                Variant("ours ort-fp32, chunk graphs", "wan-vae-ours", str(run.default_artifact))]
    counts = [int(f) for f in a.wan_vae_frames.split(",")]
    rows, peaks_by = [], {}
    for frames in counts:
        job = {"job": "vae_decode", "height": height, "width": width, "frames": frames, "tiling": False}
        samples, peaks, failed = interleaved_fresh(variants, run.constants, job, a.wan_vae_reps, log)
        if failed:
            raise RuntimeError(f"wan VAE decode at {frames} frames: {'; '.join(failed.values())}")
        for v in variants:
            peaks_by.setdefault(v.label, []).append(peaks[v.label])
            rows.append([str(frames), v.label, f"{statistics.median(s['seconds'] for s in samples[v.label]):.1f}",
                         f"{peaks[v.label]:.0f}"])
    growth = [f"{label}: {p[-1] / p[0]:.2f}x from {counts[0]} to {counts[-1]} frames" for label, p in peaks_by.items()]
    return [{"reps": a.wan_vae_reps,
             "title": f"Wan 2.1 VAE decode at {height}x{width} by frame count: seconds and peak RSS",
             "columns": ["frames", "variant", "decode s", "peak RSS MiB"],
             "rows": rows,
             "notes": [f"Medians of {a.wan_vae_reps} repetitions, each in a fresh process (the peak RSS includes the "
                       "weights and the decoded frames, float32). Ours decodes a latent frame per call of its chunk "
                       "graphs, the feature cache carried between them as a tensor; diffusers' decodes the clip in one "
                       "call (its own frame loop and Python cache). Peak RSS growth: " + "; ".join(growth) +
                       " (goal for ours: within 1.2x from 17 to 81 frames)."]}]


def _arguments(group) -> None:
    group.add_argument("--wan-vae-frames", default="17,33,81", help="comma-separated frame counts of the wan-vae table")
    group.add_argument("--wan-vae-size", default="480x832", help="the frame size (HxW) of the wan-vae table")
    group.add_argument("--wan-vae-reps", type=int, default=3, help="repetitions of the wan-vae table")


TABLE = Table("wan-vae", "Wan 2.1 VAE decode", "nothing", ("wan",), _measure, _arguments,
              smoke=("--wan-vae-frames", "5,9", "--wan-vae-size", "64x64", "--wan-vae-reps", "1"))
