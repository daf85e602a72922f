"""The Flux table: FLUX.1 dev (--steps, 28) and schnell (--flux-schnell-steps, 4) at --size, on the
same weights and packed starting latents: diffusers eager fp32; our ort-fp32, openvino-bf16 and
openvino-int8 artifacts, and one of them with a TaylorSeer step cache; with --optimum-intel-python,
optimum-intel's OVFluxPipeline on its own export and openvino.genai's Text2ImagePipeline on that
same export, its default step cache on and off.

schnell is the same transformer run at schnell's step count: flux-bench is dev-like (it has the
guidance embedding, a 256-wide MLP on one scalar, a negligible share of a step), and a second
export without it would double the table's exports and builds for the same step time."""
from __future__ import annotations

import statistics
import tempfile

import numpy as np

from bench import accuracy
from bench.harness import Variant, against_first, in_prepared_child, interleaved_fresh, log
from bench.optimum_intel import openvino_peers
from bench.tables import Table
from bench.tables.openvino import build_openvino
from bench.tables.family_table import load_goal

OURS = ("openvino-bf16", "openvino-int8")  # built besides the default ort-fp32 artifact
# openvino.genai's default step cache for Flux (its ImageGenerationConfig), the schedule our cached row runs.
GENAI_CACHE = "taylorseer:interval=3,before=6,after=-2"


def _cached_label(args) -> str:
    return f"ours {args.flux_cached_artifact}, cache {args.flux_cache}"


def _variants(run, built: dict[str, str]) -> tuple[list[Variant], list[str]]:
    """The table's variants, diffusers eager first, and notes on the peers."""
    a, ours = run.args, {"ort-fp32": str(run.default_artifact), **built}
    variants = [Variant("(a) diffusers FluxPipeline, eager fp32", "flux-diffusers", str(run.src.folder))]
    variants += [Variant(f"ours {label}", "flux-ours", path) for label, path in ours.items()]
    variants.append(Variant(_cached_label(a), "flux-ours", ours[a.flux_cached_artifact],
                            options={"cache": a.flux_cache}))
    peers, notes = openvino_peers(run, "OVFluxPipeline", "flux-optimum-intel",
                                  [("its defaults (step cache on)", {}), ("step cache off", {"cache": False})])
    return variants + peers, notes


def _goals(rows: dict[str, dict], variants: list[Variant], cached: str) -> str:
    """Issue 34's goals, each as measured (those whose rows this run has): ratios of dev end-to-end medians."""
    peer, genai, genai_off = (v.label for v in variants[-3:])
    goals = [(f"ours {OURS[1]}", peer, "optimum-intel's defaults", "1.5x"),
             (f"ours {OURS[0]}", genai_off, "openvino.genai with its cache off", "1x"),
             (cached, genai, "openvino.genai's default (cache on)", "1.5x")]
    said = [f"{ours[5:]} is {rows[theirs]['dev'] / rows[ours]['dev']:.2f}x as fast as {what} (goal {goal})"
            for ours, theirs, what, goal in goals if ours in rows]
    return f"Goals, dev end to end: {'; '.join([*said, load_goal(rows)])}."


def measure(run) -> list[dict]:
    a = run.args
    names = a.flux_artifacts.split(",")
    if a.flux_cached_artifact not in ("ort-fp32", *names):  # before the minutes of building
        raise ValueError(f"flux table: --flux-cached-artifact {a.flux_cached_artifact} is not built: choose from "
                         f"ort-fp32, {', '.join(names)}")
    built = in_prepared_child(build_openvino, run.build, accuracy.calibration(a), a.size, names)
    variants, notes = _variants(run, built)
    with tempfile.TemporaryDirectory(prefix="bench-flux-") as images:
        job = {"height": a.size, "width": a.size}
        jobs = [{"job": "loaded", **job}, {"job": "timed_run", "steps": 1, **job},  # cold: the first call
                {"job": "timed_run", "steps": a.steps, "out": images, **job},
                {"job": "timed_run", "steps": a.flux_schnell_steps, **job}]
        samples, peaks, failed = interleaved_fresh(variants, run.constants, jobs, a.flux_reps, log)
        if failed:
            raise RuntimeError(f"flux table: {'; '.join(failed.values())}")
        reference = samples["ours ort-fp32"][0][2]["image"]
        psnr = {v.label: accuracy.psnr(np.load(reference), np.load(samples[v.label][0][2]["image"]))
                for v in variants}
    dev = against_first(variants, samples, lambda s: s[2]["seconds"])
    schnell = against_first(variants, samples, lambda s: s[3]["seconds"])
    rows, measured = [], {}
    for (v, dev_st, dev_ratio), (_, schnell_st, schnell_ratio) in zip(dev, schnell):
        s, med = samples[v.label], statistics.median
        first = med(r[0]["seconds"] + r[1]["seconds"] for r in s)
        measured[v.label] = {"dev": dev_st.median, "first": first}
        rows.append([v.label, f"{med(r[2]['step'] for r in s):.2f}", f"{med(r[2]['vae'] for r in s):.2f}",
                     f"{dev_st.median:.1f}", dev_ratio, f"{schnell_st.median:.1f}", schnell_ratio, f"{first:.1f}",
                     f"{peaks[v.label]:.0f}", "reference" if v.label == "ours ort-fp32" else f"{psnr[v.label]:.1f}"])
    if a.optimum_intel_python:
        notes.append(_goals(measured, variants, _cached_label(a)))
    return [{
        "reps": a.flux_reps,
        "title": f"Flux at {a.size}x{a.size}: dev ({a.steps} steps) and schnell ({a.flux_schnell_steps} steps), "
                 "step, VAE decode, end to end, load, image error against ort-fp32",
        "columns": ["variant", "step s (dev)", "VAE decode s", f"dev end to end s ({a.steps} steps)",
                    "speed-up vs (a)", f"schnell end to end s ({a.flux_schnell_steps} steps)", "speed-up vs (a)",
                    "load + first call s (a 1-step image)", "peak RSS MiB", "image PSNR dB vs ort-fp32 (dev)"],
        "rows": rows,
        "notes": [f"Medians of {a.flux_reps} repetitions; each runs every variant in a fresh process, in turn: "
                  "load, a cold 1-step image (with the load: the load + first call column), then a dev and a "
                  "schnell image, every one from the same packed starting latents and one prompt, at each "
                  "pipeline's defaults (512 T5 tokens, guidance embedding 3.5, no negative prompt). Step: the "
                  "dev run's transformer seconds per step (with a step cache, cached steps count as steps); "
                  "VAE decode: that run's. schnell is the same dev-like transformer at schnell's step count "
                  "(the guidance embedding stays, the schedule is the export's). The cached row runs "
                  f"`cache=\"{a.flux_cache}\"`, openvino.genai's default schedule for Flux. PSNR: the dev image "
                  "against ort-fp32's (openvino.genai returns 8-bit images: about 59 dB at best). openvino-int8 "
                  f"is calibrated on {accuracy.calibration_text(a)}.", *notes]}]


def _arguments(group) -> None:
    group.add_argument("--flux-schnell-steps", type=int, default=4, help="steps of the flux table's schnell runs")
    group.add_argument("--flux-reps", type=int, default=3, help="repetitions of the flux table")
    group.add_argument("--flux-cache", default=GENAI_CACHE, help="the step cache of the flux table's cached row")
    group.add_argument("--flux-artifacts", default=",".join(OURS),
                       help="comma-separated artifacts of the flux table besides ort-fp32 (the openvino table's labels)")
    group.add_argument("--flux-cached-artifact", default=OURS[1], help="the artifact of the flux table's cached row: "
                       "ort-fp32 or one of --flux-artifacts")


# --optimum-intel-python (the openvino table's option) adds the optimum-intel and openvino.genai rows.
TABLE = Table("flux", "Flux at", "openvino bf16 and int8 (calibrated); optimum-intel's export with "
              "--optimum-intel-python", ("flux",), measure, _arguments,
              smoke=(*accuracy.SMOKE, "--flux-reps", "1", "--flux-schnell-steps", "1", "--flux-artifacts",
                     "openvino-bf16", "--flux-cached-artifact", "openvino-bf16"))
