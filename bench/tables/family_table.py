"""The table of a family whose prompt encoder is an LLM (Z-Image's, FLUX.2's: `FamilyTable`, one module each in
bench/tables/): the model's settings (its bench.family_variants.Workload) at each of --<name>-sizes, on the same
weights, starting latents and 20-word prompt, for text to image and for editing from 1, 2... seeded reference
images where the family edits: diffusers eager fp32; our ort-fp32, openvino-bf16, openvino-int8 and openvino bf16
with int4 weights; with --optimum-intel-python, optimum-intel's pipeline on its own export and openvino.genai's
Text2ImagePipeline on that same export (for editing from one reference, its Image2ImagePipeline), each at its
defaults.
Columns: the text encoder, a step, the VAE decode, end to end, load plus a first call, peak RSS and the image's
PSNR against ort-fp32. The family's module gives its goals as a note per size and task."""
from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bench import accuracy
from bench.family_variants import PROMPT, WORKLOADS
from bench.harness import Variant, against_first, in_prepared_child, interleaved_fresh, log
from bench.optimum_intel import openvino_peers
from bench.tables import Table
from bench.tables.openvino import build_openvino

OURS = ("openvino-bf16", "openvino-int8", "openvino-bf16-int4-weights")  # besides the default ort-fp32
REFERENCE = "ours ort-fp32"
OURS_INT8 = "ours openvino-int8"


def int8_against_peers(rows: dict, variants) -> list[str]:
    """openvino-int8's end-to-end median against the last two variants' (optimum-intel's and openvino.genai's
    default, the issues' 1.5x goal), in words; [] without an openvino-int8 row."""
    if OURS_INT8 not in rows:
        return []
    peer, genai = (v.label for v in variants[-2:])
    return [f"openvino-int8 end to end is {rows[theirs]['e2e'] / rows[OURS_INT8]['e2e']:.2f}x as fast as {what} "
            "(goal 1.5x)" for theirs, what in ((genai, "openvino.genai's default"), (peer, "optimum-intel's"))]


def load_goal(rows: dict) -> str:
    """Our artifacts' load plus first call against the issues' 10 s, in words: the fastest (what a deployment
    would choose) and the slowest, each named."""
    ours = sorted((r["first"], label.removeprefix("ours ")) for label, r in rows.items() if label.startswith("ours"))
    (fastest, which), (slowest, what) = ours[0], ours[-1]
    return (f"our fastest load + first call is {fastest:.1f} s ({which}), the slowest {slowest:.1f} s ({what}) "
            "(goal under 10 s)")


@dataclass(frozen=True)
class FamilyTable:
    name: str  # the table's (`--tables`), its options' prefix and its workload's (bench.family_variants.WORKLOADS)
    family: str  # export/families'
    title: str  # the start of its BENCHMARKS.md section title
    steps: int  # the model's own
    settings: str  # the title's words for the workload ("guidance 0")
    edits: tuple[int, ...] = ()  # the reference counts of its editing rows
    text_to_image: bool = True  # whether its model makes images from text alone (an Edit model does not)
    # ("HxW", task, {variant label: {"e2e", "first", "text", "step"}}, variants, every measured task's) -> a note
    goals: Callable[..., str | None] | None = None
    sizes: str = "512,1024"  # the default --<name>-sizes: sides, or HxW
    frames: int | None = None  # a video model's default --<name>-frames (its rows are videos of that many frames)
    smoke_frames: int = 5  # a video model's frames in the smoke test (the fewest its tiny model's range holds)
    prompt_tokens: int = 512  # the pipelines' maximum prompt length (LTX-Video's T5: 128)
    # the cold call's and the smoke test's steps (2 where the schedule's terminal stretch cannot take 1: LTX-Video's,
    # Qwen-Image's)
    cold_steps: int = 1
    caches: tuple[str, ...] = ()  # step caches (the CLI's --cache spelling) each of our artifacts runs with too
    task: str = "text to image"  # what its rows without references make


def _sides(text: str) -> tuple[int, int]:
    """A --<name>-sizes entry: "512" (square) or "480x832" (height x width)."""
    height, _, width = text.partition("x")
    return int(height), int(width or height)


def _task(spec: FamilyTable, references: int) -> str:
    return spec.task if not references else f"editing, {references} reference{'s' * (references > 1)}"


def _variants(spec: FamilyTable, run, built: dict[str, str], references: int) -> tuple[list[Variant], list[str]]:
    """The variants of one task, diffusers eager first, and notes on the peers. The peers run text to image and
    one reference (optimum-intel's pipeline; openvino.genai's Image2ImagePipeline takes one image)."""
    w, options = WORKLOADS[spec.name], {"references": references} if references else {}
    ours = {"ort-fp32": str(run.default_artifact), **built}
    settings = w.entry_settings(run.src)
    variants = [Variant(f"(a) diffusers {w.diffusers}, eager fp32", f"{spec.name}-diffusers", str(run.src.folder),
                        options={**options, **({"settings": settings} if settings else {})})]
    variants += [Variant(f"ours {label}", f"{spec.name}-ours", path, options=options) for label, path in ours.items()]
    variants += [Variant(f"ours {label} + {cache.split(':')[0]}", f"{spec.name}-ours", path,
                         options={**options, "cache": cache}) for cache in spec.caches for label, path in ours.items()]
    if references > 1:
        return variants, []
    if w.optimum_intel is None:
        return variants, [f"No peer runs {w.diffusers} on a CPU: optimum-intel and openvino.genai have no such "
                          "pipeline; the goal is against diffusers eager."]
    peers, notes = openvino_peers(run, w.optimum_intel, f"{spec.name}-optimum-intel",
                                  [("its defaults", {"prompt": PROMPT, **w.options, **options})],
                                  "editing" if references else spec.task, w.genai_renames)
    return variants + [dataclasses.replace(v, options=options) if not v.kind.startswith("genai") else v
                       for v in peers], notes


def _measure(spec: FamilyTable, run, variants: list[Variant], size: tuple[int, int], references: int,
             rows: list) -> dict:
    """One size and task's rows; returns what each variant measured."""
    a = run.args
    reps, steps = getattr(a, f"{_arg(spec)}_reps"), getattr(a, f"{_arg(spec)}_steps")
    frames = getattr(a, f"{_arg(spec)}_frames", None)
    with tempfile.TemporaryDirectory(prefix=f"bench-{spec.name}-") as images:
        job = {"height": size[0], "width": size[1], **({"frames": frames} if frames else {})}
        cold = {"job": "timed_run", "steps": spec.cold_steps, **job}  # the first call
        jobs = [{"job": "loaded", **job}, cold, {"job": "timed_run", "steps": steps, "out": images, **job}]
        samples, peaks, failed = interleaved_fresh(variants, run.constants, jobs, reps, log)
        if failed:
            raise RuntimeError(f"{spec.name} table at {size}, {_task(spec, references)}: {'; '.join(failed.values())}")
        reference = np.load(samples[REFERENCE][0][2]["image"])
        psnr = {v.label: accuracy.psnr(reference, np.load(samples[v.label][0][2]["image"])) for v in variants
                if v.label != REFERENCE}
    measured = {}
    for v, st, ratio in against_first(variants, samples, lambda s: s[2]["seconds"]):
        s, med = samples[v.label], statistics.median
        first, text, step = (med(r[0]["seconds"] + r[1]["seconds"] for r in s), med(r[2]["text"] for r in s),
                             med(r[2]["step"] for r in s))
        measured[v.label] = {"e2e": st.median, "first": first, "text": text, "step": step}
        rows.append([f"{size[0]}x{size[1]}", _task(spec, references), v.label, f"{text:.3f}", f"{step:.2f}",
                     f"{med(r[2]['vae'] for r in s):.2f}", f"{st.median:.1f}", ratio, f"{first:.1f}",
                     f"{peaks[v.label]:.0f}", "reference" if v.label == REFERENCE else f"{psnr[v.label]:.1f}"])
    return measured


def _tasks(spec: FamilyTable) -> tuple[int, ...]:
    """The reference counts of its rows: 0 is text to image."""
    return (0,) * spec.text_to_image + spec.edits


def _chosen_tasks(spec: FamilyTable, given: str) -> tuple[int, ...]:
    """--<name>-tasks: reference counts among the table's tasks, in its order."""
    chosen = {int(t) for t in given.split(",") if t.strip().isdigit()}
    if not chosen or not chosen <= set(_tasks(spec)) or len(chosen) != len(given.split(",")):
        raise ValueError(f"--{spec.name}-tasks {given}: use some of {','.join(map(str, _tasks(spec)))} (0: "
                         f"{spec.task}; n: editing from n references)")
    return tuple(t for t in _tasks(spec) if t in chosen)


def _arg(spec: FamilyTable) -> str:
    return spec.name.replace("-", "_")


def _measure_table(spec: FamilyTable, run) -> list[dict]:
    a, prefix = run.args, _arg(spec)
    sizes = [_sides(s) for s in getattr(a, f"{prefix}_sizes").split(",")]
    names = [n for n in getattr(a, f"{prefix}_artifacts").split(",") if n]
    reps, steps = getattr(a, f"{prefix}_reps"), getattr(a, f"{prefix}_steps")
    frames = getattr(a, f"{prefix}_frames", None)
    tasks = _chosen_tasks(spec, getattr(a, f"{prefix}_tasks"))
    built = in_prepared_child(build_openvino, run.build, accuracy.calibration(a), sizes[0][0], names)
    rows, notes = [], []
    for size in sizes:
        measured = {}
        for references in tasks:
            variants, peer_notes = _variants(spec, run, built, references)
            notes += [n for n in peer_notes if n not in notes]
            measured[references] = _measure(spec, run, variants, size, references, rows)
            # the goals are against the peers where the model has any (run with --optimum-intel-python)
            with_peers = a.optimum_intel_python or WORKLOADS[spec.name].optimum_intel is None
            note = spec.goals and with_peers and spec.goals(f"{size[0]}x{size[1]}", references, measured, variants)
            if note:
                notes.append(note)
    tasks = " and ".join(_task(spec, r) for r in tasks)
    clip = f", {frames} frames" if frames else ""
    return [{
        "reps": reps,
        "title": f"{spec.title} ({steps} steps, {spec.settings}) at {' and '.join(f'{h}x{w}' for h, w in sizes)}"
                 f"{clip}, {tasks}: text encoder, step, VAE decode, end to end, load, image error against ort-fp32",
        "columns": ["size", "task", "variant", "text encoder s", "step s", "VAE decode s", "end to end s",
                    "speed-up vs (a)", f"load + first call s (a {spec.cold_steps}-step image)", "peak RSS MiB",
                    "image PSNR dB vs ort-fp32"],
        "rows": rows,
        "notes": [f"Medians of {reps} repetitions; each runs every variant in a fresh process, in turn: load, a cold "
                  f"{spec.cold_steps}-step image (with the load: the load + first call column), then an image of "
                  f"{steps} steps, every one from the same starting latents and the prompt \"{PROMPT}\" (20 words), "
                  f"{spec.settings}, each pipeline's maximum prompt length ({spec.prompt_tokens} tokens). Editing "
                  "starts from the same seeded reference images (smooth colour fields of the image's size). Text "
                  "encoder: the run's encoder seconds; step: its transformer seconds per step; VAE decode: its "
                  "decode. PSNR: the image against ort-fp32's (openvino.genai returns 8-bit images: about 59 dB at "
                  f"best). openvino-int8 is calibrated on {accuracy.calibration_text(a)}.", *notes]}]


def make_table(spec: FamilyTable) -> Table:
    prefix = f"--{spec.name}"

    def arguments(group) -> None:
        group.add_argument(f"{prefix}-sizes", default=spec.sizes, help=f"comma-separated image sides (or HxW) of the "
                           f"{spec.name} table")
        if spec.frames:
            group.add_argument(f"{prefix}-frames", type=int, default=spec.frames, help=f"frames of the {spec.name} "
                               "table's videos")
        group.add_argument(f"{prefix}-steps", type=int, default=spec.steps, help=f"steps of the {spec.name} table "
                           f"(the model's {spec.steps})")
        group.add_argument(f"{prefix}-reps", type=int, default=3, help=f"repetitions of the {spec.name} table")
        group.add_argument(f"{prefix}-tasks", default=",".join(map(str, _tasks(spec))),
                           help=f"comma-separated tasks of the {spec.name} table: 0 is {spec.task}, n editing from n "
                                "reference images")
        group.add_argument(f"{prefix}-artifacts", default=",".join(OURS),
                           help=f"comma-separated artifacts of the {spec.name} table besides ort-fp32 (the openvino "
                                "table's labels)")

    # --optimum-intel-python (the openvino table's option) adds the optimum-intel and openvino.genai rows.
    return Table(spec.name, spec.title, "openvino bf16, int8 (calibrated) and bf16 with int4 weights; optimum-intel's "
                 "export with --optimum-intel-python", (spec.family,), lambda run: _measure_table(spec, run), arguments,
                 smoke=(*accuracy.FAMILY_SMOKE, f"{prefix}-reps", "1", f"{prefix}-steps", str(spec.cold_steps),
                        f"{prefix}-sizes", "64", f"{prefix}-artifacts", "openvino-int8",
                        # one task: editing from one reference where the model edits (text to image's code with
                        # the references'; more references run the same; the goals' words: test_bench_report)
                        f"{prefix}-tasks", str((spec.edits or _tasks(spec))[0]),
                        *((f"{prefix}-frames", str(spec.smoke_frames)) if spec.frames else ())))
