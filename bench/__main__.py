"""python -m bench: time diffusers, Optimum-ONNX and our artifacts on the same workload, with the
same weights and starting latents, and write BENCHMARKS.md."""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.harness import Variant, in_child, interleaved, interleaved_fresh, peak_rss, running, stats
from bench.report import render
from runners.manifest import read_manifest

SUBMODULES = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder")
TABLES = ("submodules", "e2e", "passes", "profile", "precision", "openvino", "profiling", "tiling", "copies", "memory",
          "export", "serving", "lora")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--model", default="sd3-bench")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--size", type=int, default=512, help="image side of the per-submodule and first end-to-end runs")
    p.add_argument("--steps", type=int, default=28, help="steps of the first end-to-end run (0: skip it)")
    p.add_argument("--large-size", type=int, default=1024, help="image side of the second end-to-end run (0: skip)")
    p.add_argument("--large-steps", type=int, default=2)
    p.add_argument("--profiling-steps", type=int, default=4, help="steps of the profiling-cost runs")
    p.add_argument("--tiling-sizes", default="1024,2048", help="image sides of the tiled-decode table")
    p.add_argument("--memory-size", type=int, default=1024, help="image side of the memory table's runs")
    p.add_argument("--memory-batch", type=int, default=1, help="batch of the memory table's runs")
    p.add_argument("--memory-submodules", default="vae_decoder,vae_encoder",
                   help="the submodules of the memory table (sd15-bench: unet)")
    p.add_argument("--precision-steps", type=int, default=4, help="steps of the precision table's end-to-end runs")
    p.add_argument("--calibration-size", type=int, default=256, help="image side of the fp16/fp8 calibration run")
    p.add_argument("--calibration-steps", type=int, default=4, help="denoising steps per calibration prompt")
    p.add_argument("--compile", action="store_true", help="add (b) diffusers + torch.compile (compiles for minutes)")
    p.add_argument("--optimum-python", default=None,
                   help="python of an environment with optimum-onnx (make optimum-venv): adds (c)")
    p.add_argument("--optimum-intel-python", default=None,
                   help="python of an environment with optimum-intel (make optimum-intel-venv): adds it to the "
                        "openvino table")
    p.add_argument("--openvino-reps", type=int, default=3,
                   help="repetitions of the openvino table (each runs every variant end to end at --size, --steps)")
    p.add_argument("--openvino-variants", default=None,
                   help="comma-separated labels of the openvino table's variants to build and run besides ort-int8 "
                        "(default: all)")
    p.add_argument("--serving-size", type=int, default=512, help="image side of the serving table's requests")
    p.add_argument("--serving-steps", type=int, default=4, help="steps of the serving table's requests")
    p.add_argument("--serving-requests", type=int, default=8, help="requests per row of the serving table")
    p.add_argument("--serving-clients", default="1,4,8", help="the serving table's numbers of concurrent clients")
    p.add_argument("--lora-steps", type=int, default=4, help="steps of the LoRA table's runs (at --size)")
    p.add_argument("--tables", default=",".join(TABLES),
                   help=f"comma-separated tables to measure, of {', '.join(TABLES)}; the other tables already in "
                        "--out are kept as they are, each with the command that produced it")
    p.add_argument("--out", default="BENCHMARKS.md")
    p.add_argument("--build-dir", default="build", help="where the model's export and artifacts are built (cached)")
    args = p.parse_args(argv)
    args.tables = [t for t in args.tables.split(",") if t]
    unknown = [t for t in args.tables if t not in TABLES]
    if unknown:
        p.error(f"unknown table {', '.join(unknown)}: choose from {', '.join(TABLES)}")
    return args


class Bench:
    def __init__(self, args, command: str):
        self.args, self.command = args, command
        self.tables = []
        self.started = time.perf_counter()

    def prepare(self):
        """Export and build our artifact (cached), and Optimum's export when asked for."""
        from bench.prepare import export_and_build
        from export.source import resolve

        self.build = in_child(export_and_build, self.args.model, Path(self.args.build_dir))
        self.src = resolve(self.args.model)  # built by the child: only read here
        self.onnx_dir = self.build / "onnx"
        self.onnx_manifest = read_manifest(self.onnx_dir, verify=False)  # export_model just verified it
        self.constants = self.onnx_manifest["constants"]
        self.artifacts = sorted(d for d in self.build.iterdir()
                                if d.is_dir() and d.name not in ("onnx", "optimum") and (d / "manifest.json").exists())
        self.default_artifact = self.build / "ort-fp32"  # the one the other precisions are measured against
        self.variants = [Variant("(a) diffusers eager", "diffusers", str(self.src.folder))]
        if self.args.compile:
            self.variants.append(Variant("(b) diffusers torch.compile", "diffusers-compile", str(self.src.folder)))
        self.optimum_seconds = self.optimum_folder = None
        if self.args.optimum_python:
            from bench.optimum import optimum_export

            folder, self.optimum_seconds = optimum_export(self.args.optimum_python, self.src.folder, self.build, _log)
            self.optimum_folder = folder
            self.variants.append(Variant("(c) optimum-onnx", "optimum", str(folder), self.args.optimum_python))
        self.variants.append(Variant(f"(d) ours {self.default_artifact.name}", "ours", str(self.default_artifact)))
        self.reference = self.variants[0].label

    def measure_gemm(self):
        from bench.gemm import gemm_gflops

        _log("measuring fp32 GEMM throughput")
        self.gemm = gemm_gflops()
        self.rate = max(self.gemm.values()) * 1e9

    def dims(self, size: int, submodule: str) -> dict[str, int]:
        """The dynamic dims of one benchmark call (bench.variants.submodule_inputs makes its inputs)."""
        c, scale = self.constants, self.constants["vae_scale_factor"]
        return {"latent_height": size // scale, "latent_width": size // scale, "image_height": size,
                "image_width": size, "t5_length": 256, "joint_length": c["clip_length"] + 256,
                "batch": 2 if submodule == "transformer" else 1}

    def flops(self, size: int) -> dict[str, int]:
        from engines.memory.graph import graph_flops

        return {n: graph_flops(self.onnx_dir / f"{n}.onnx", self.dims(size, n)) for n in SUBMODULES}

    def _row(self, samples: dict, key, label: str):
        ref = [key(s) for s in samples[self.reference]]
        return stats([key(s) for s in samples[label]], None if label == self.reference or not ref else ref)

    def _ratio(self, st, v) -> str:
        return "1 (reference)" if v.label == self.reference else st.ratio_text()

    def measure(self):
        """Per-submodule calls and end-to-end runs of every variant: one table each."""
        a = self.args
        size = a.size
        job = {"height": size, "width": size}
        e2e_here = "e2e" in a.tables and a.steps
        rows = []
        if "submodules" in a.tables or e2e_here:
            f = self.flops(size)
            with running(self.variants, self.constants, _log) as workers:
                # Also the warm-up of the end-to-end runs.
                per_call = interleaved(workers, {"job": "submodules", **job}, a.reps, _log)
                if e2e_here:
                    e2e = interleaved(workers, {"job": "e2e", "steps": a.steps, **job}, a.reps, _log, warmup=False)
                    rows = self._e2e_rows(size, a.steps, f, e2e, peak_rss(workers))
            if "submodules" in a.tables:
                self.submodule_table(size, f, per_call)
        notes = []
        if "e2e" in a.tables and a.large_size:
            large = {"job": "e2e", "height": a.large_size, "width": a.large_size, "steps": a.large_steps}
            samples, peaks, failed = interleaved_fresh(self.variants, self.constants, large, a.reps, _log)
            rows += self._e2e_rows(a.large_size, a.large_steps, self.flops(a.large_size), samples, peaks, failed)
            notes.append(f"{a.large_size}x{a.large_size} runs are cold: each comes from a fresh process, stopped "
                         "before the next starts, because the variants' pipelines at that size do not fit in "
                         "memory side by side.")
        if rows:
            self.tables.append({"title": "End to end: prompt and negative prompt, guidance 7, VAE decode",
                                "columns": ["workload", "variant", "TFLOP", "median s", "speed-up vs (a)",
                                            "x bound", "peak RSS MiB"], "rows": rows, "notes": notes})

    def submodule_table(self, size, f, per_call):
        rows = []
        for name in SUBMODULES:
            for v in self.variants:
                st = self._row(per_call, lambda s: s[name], v.label)
                rows.append([name, v.label, f"{f[name] / 1e9:.1f}", f"{st.median * 1e3:.0f}", self._ratio(st, v),
                             f"{st.median / (f[name] / self.rate):.2f}"])
        self.tables.append({"title": f"One call per submodule at {size}x{size} (transformer: one step at batch 2)",
                            "columns": ["submodule", "variant", "GFLOP", "median ms", "speed-up vs (a)", "x bound"],
                            "rows": rows})

    def measure_passes(self):
        """The transformer step through each pass list, against the peers' graphs of the same weights."""
        from bench.tables.passes import build_with_passes, ort_optimizer

        if "passes" not in self.args.tables:
            return
        a, root = self.args, self.build / "passes"
        graphs = in_child(build_with_passes, self.onnx_dir, root, "transformer")
        variants = [Variant(f"ours, {label}", "graph", str(path)) for label, (path, _) in graphs.items()]
        changed = {f"ours, {label}": _what_changed(reports) for label, (_, reports) in graphs.items()}
        path, fused = in_child(ort_optimizer, self.onnx_dir, root, "transformer", "mmdit")
        variants.append(Variant("ONNX Runtime optimizer (mmdit) on our export", "graph", str(path)))
        changed[variants[-1].label] = ", ".join(f"{k} {v}" for k, v in fused.items()) or "fused nothing"
        if self.optimum_folder is not None:
            variants.append(Variant("Optimum-ONNX export", "graph", str(self.optimum_folder / "transformer" / "model.onnx")))
            changed[variants[-1].label] = "legacy exporter, no ORT optimizer"
        job = {"job": "submodules", "names": ["transformer"], "calls": 3, "height": a.size, "width": a.size}
        # One graph in memory at a time (seven transformers and their arenas do not fit side by side),
        # each timed in steady state after a warm-up call, as in the denoising loop.
        samples, peaks, failed = interleaved_fresh(variants, self.constants, job, a.reps, _log, warmup=True)
        if failed:
            raise RuntimeError(f"pass table: {'; '.join(failed.values())}")
        flops = self.flops(a.size)["transformer"]
        rows = [[v.label, changed[v.label], f"{st.median * 1e3:.0f}", ratio, f"{st.median / (flops / self.rate):.2f}",
                 f"{peaks[v.label]:.0f}"]
                for v, st, ratio in _against_first(variants, samples, lambda s: s["transformer"])]
        self.tables.append({
            "title": f"Transformer step by graph pass at {a.size}x{a.size}, batch 2 ({flops / 1e9:.1f} GFLOP)",
            "columns": ["graph", "what the passes did", "median ms", "speed-up vs no passes", "x bound",
                        "peak RSS MiB"],
            "rows": rows,
            "notes": ["Each graph runs in the runner's ONNX Runtime session (CPU, memory pattern off), so only the "
                      "graph differs. Every repetition starts a fresh process, makes one untimed warm-up call and "
                      "takes the median of the next three; the graphs take turns (A B C ... A B C ...)."]})

    def _e2e_rows(self, size, steps, f, samples, peaks, failed=None):
        total = 2 * sum(f[n] for n in SUBMODULES[:3]) + steps * f["transformer"] + f["vae_decoder"]
        rows = []
        for v in self.variants:
            if v.label in (failed or {}):
                rows.append([f"{size}x{size}, {steps} steps", v.label, f"{total / 1e12:.2f}", "failed", "-", "-",
                             failed[v.label].split(": ", 1)[1]])
                continue
            st = self._row(samples, lambda s: s["seconds"], v.label)
            rows.append([f"{size}x{size}, {steps} steps", v.label, f"{total / 1e12:.2f}", f"{st.median:.1f}",
                         self._ratio(st, v), f"{st.median / (total / self.rate):.2f}", f"{peaks[v.label]:.0f}"])
        return rows

    def profile(self):
        """Where the step's time goes in the graph the ORT target builds: per op type, its time, its
        FLOPs and how far it runs from its own FLOP bound."""
        from engines.memory.graph import graph_flops_by_op
        from bench.tables.passes import build_with_passes, op_profile

        if "profile" not in self.args.tables:
            return
        size = self.args.size
        label = "all (ort default)"
        graph = in_child(build_with_passes, self.onnx_dir, self.build / "passes", "transformer", [label])[label][0]
        seconds = in_child(op_profile, graph, self.constants, size)
        flops = in_child(graph_flops_by_op, graph, self.dims(size, "transformer"))
        total = sum(seconds.values())
        rows, shown = [], 0.0
        for op, t in seconds.items():
            if shown >= 0.97 * total:
                break
            shown += t
            f = flops.get(op)
            rows.append([op, f"{t * 1e3:.0f}", f"{100 * t / total:.1f}%", f"{f / 1e9:.1f}" if f else "-",
                         f"{f / t / 1e9:.0f}" if f else "-", f"{t / (f / self.rate):.2f}" if f else "-"])
        rows.append(["all ops", f"{total * 1e3:.0f}", "100%", f"{sum(flops.values()) / 1e9:.1f}",
                     f"{sum(flops.values()) / total / 1e9:.0f}", f"{total / (sum(flops.values()) / self.rate):.2f}"])
        self.tables.append({
            "title": f"Transformer step at {size}x{size}, batch 2, by op type (ort target, all passes)",
            "columns": ["op type", "ms", "share", "GFLOP", "GFLOP/s", "x own bound"], "rows": rows,
            "notes": ["ONNX Runtime's profiler, one steady-state call (the second) in the runner's session settings; "
                      "ops are listed until 97% of the kernel time is covered. Rows without FLOPs are memory-bound "
                      "ops (Add, Gelu, LayerNorm, reshapes)."]})

    def _built_and_checked(self, build, *args) -> tuple[dict[str, str], dict[str, dict]]:
        """The artifacts `build(build_dir, calibration settings, *args)` makes ({label: folder}, in a
        child process), and their error against the default artifact (bench.tables.precision.accuracy)."""
        from bench.tables.precision import accuracy

        a = self.args
        calibration = {"prompts": 32, "steps": a.calibration_steps, "size": a.calibration_size}
        built = in_child(build, self.build, calibration, *args)
        return built, in_child(accuracy, str(self.default_artifact), built, self.constants, a.size, a.precision_steps)

    def measure_precision(self):
        """Each precision ONNX Runtime's CPU runs: the transformer step and a whole run against diffusers
        eager fp32, and the error of its images and transformer output against the fp32 artifact."""
        from bench.tables.precision import PRECISIONS, PROMPTS, build_precisions

        if "precision" not in self.args.tables:
            return
        a = self.args
        built, errors = self._built_and_checked(build_precisions)
        artifacts = {"reference": str(self.default_artifact), **built}
        variants = [self.variants[0]] + [Variant(f"ours {Path(path).name}", "ours", path) for path in artifacts.values()]
        precision_of = {v.label: p for v, p in zip(variants[1:], artifacts)}
        step = {"job": "submodules", "names": ["transformer"], "calls": 3, "height": a.size, "width": a.size}
        e2e = {"job": "e2e", "steps": a.precision_steps, "height": a.size, "width": a.size}
        samples, peaks, failed = interleaved_fresh(variants, self.constants, [step, e2e], a.reps, _log, warmup=True)
        if failed:
            raise RuntimeError(f"precision table: {'; '.join(failed.values())}")
        steps = _against_first(variants, samples, lambda s: s[0]["transformer"])
        runs = _against_first(variants, samples, lambda s: s[1]["seconds"])
        rows = []
        for (v, st, ratio), (_, run, run_ratio) in zip(steps, runs):
            rows.append([v.label, f"{st.median * 1e3:.0f}", ratio, f"{run.median:.1f}", run_ratio,
                         *_accuracy_cells(errors.get(precision_of.get(v.label), {})), f"{peaks[v.label]:.0f}"])
        timesteps = ", ".join(errors[PRECISIONS[0]]["transformer_rel_err"])
        self.tables.append({
            "title": f"Precision at {a.size}x{a.size}: transformer step (batch 2) and end to end ({a.precision_steps} "
                     "steps), error against ort-fp32",
            "columns": ["variant", "step ms", "step speed-up vs (a)", "end to end s", "speed-up vs (a)",
                        "image PSNR dB (worst of 4)", "image max abs", f"transformer rel. err at t = {timesteps}",
                        "all finite", "peak RSS MiB"],
            "rows": rows,
            "notes": [f"Each repetition runs every variant in a fresh process: one untimed warm-up of both jobs, then "
                      f"the median of three transformer calls and one end-to-end run. Errors: {len(PROMPTS)} prompts "
                      f"(one empty), the same starting latents, images in [0, 1] against the ort-fp32 artifact's; the "
                      f"transformer's relative error is on the fp32 pipeline's own inputs at the first, middle and "
                      f"last step. fp16 and fp8 are calibrated on 32 prompts x {a.calibration_steps} steps at "
                      f"{a.calibration_size}x{a.calibration_size} (`python -m engines --precision P "
                      f"--calibration-size {a.calibration_size} --calibration-steps {a.calibration_steps}`). "
                      "ONNX Runtime's CPU kernels run fp16 and fp8 as a simulation of the GPU numerics, mostly by "
                      "casting to fp32, so their speed here says nothing about a GPU's."]})

    def measure_openvino(self):
        """Our CPU artifacts (ONNX Runtime and OpenVINO, each precision) against diffusers eager and
        optimum-intel: the transformer step, the VAE decode and a whole run, load and first-call time,
        peak RSS, and the error against the ort-fp32 artifact."""
        from bench.tables.openvino import build_openvino
        if "openvino" not in self.args.tables:
            return
        a = self.args
        # ort-int8 is the int8 reference of the table's error column: always there
        only = ["ort-int8", *a.openvino_variants.split(",")] if a.openvino_variants else None
        built, errors = self._built_and_checked(build_openvino, a.size, only)
        variants = [self.variants[0], Variant(f"ours {self.default_artifact.name}", "ours", str(self.default_artifact))]
        variants += [Variant(f"ours {label}", "ours", path) for label, path in built.items()]
        error_of = {v.label: label for v, label in zip(variants[1:], ["reference", *built])}
        notes = []
        if a.optimum_intel_python:
            from bench.optimum_intel import optimum_intel_export

            folder, seconds = optimum_intel_export(a.optimum_intel_python, self.src.folder, self.build, _log)
            variants.append(Variant("optimum-intel OVStableDiffusion3Pipeline, its defaults", "optimum-intel",
                                    str(folder), a.optimum_intel_python))
            errors["peer"] = self._peer_error(variants[1], variants[-1])
            error_of[variants[-1].label] = "peer"
            notes.append(f"optimum-intel's export of the same folder (`optimum-cli export openvino --task "
                         f"text-to-image`, its defaults) took {seconds:.0f} s.")
        job = {"height": a.size, "width": a.size}
        jobs = [{"job": "loaded", **job}, {"job": "submodules", **job},  # cold: the first call of each engine
                {"job": "submodules", "names": ["transformer"], "calls": 3, **job},
                {"job": "submodules", "names": ["vae_decoder"], **job}, {"job": "e2e", "steps": a.steps, **job}]
        samples, peaks, failed = interleaved_fresh(variants, self.constants, jobs, a.openvino_reps, _log)
        if failed:
            raise RuntimeError(f"openvino table: {'; '.join(failed.values())}")
        rows = []
        columns = zip(*(_against_first(variants, samples, key) for key in (
            lambda s: s[2]["transformer"], lambda s: s[3]["vae_decoder"], lambda s: s[4]["seconds"])))
        for (v, step, step_ratio), (_, vae, vae_ratio), (_, run, run_ratio) in columns:
            first = statistics.median(s[0]["seconds"] + sum(s[1].values()) for s in samples[v.label])
            rows.append([v.label, f"{step.median * 1e3:.0f}", step_ratio, f"{vae.median:.2f}", vae_ratio,
                         f"{run.median:.1f}", run_ratio, f"{first:.1f}",
                         *_accuracy_cells(errors.get(error_of.get(v.label), {})), f"{peaks[v.label]:.0f}"])
        timesteps = ", ".join(errors["ort-int8"]["transformer_rel_err"])
        self.tables.append({
            "reps": a.openvino_reps,
            "title": f"CPU runtimes at {a.size}x{a.size}: transformer step (batch 2), VAE decode, end to end "
                     f"({a.steps} steps), error against ort-fp32",
            "columns": ["variant", "step ms", "step speed-up vs (a)", "VAE decode s", "VAE speed-up vs (a)",
                        "end to end s", "speed-up vs (a)", "load + first call of each submodule s",
                        f"image PSNR dB (worst of 4, {a.precision_steps} steps)", "image max abs",
                        f"transformer rel. err at t = {timesteps}", "all finite", "peak RSS MiB"],
            "rows": rows,
            "notes": [f"Medians of {a.openvino_reps} repetitions; each runs every variant in a fresh process, in "
                      "turn: load, one cold call of each submodule (with the load: the load + first call column), "
                      "three transformer calls, one VAE decode, one end-to-end run. OpenVINO's artifacts compile "
                      "their IR at load, and a per-size transformer at its first call of a size, unless compiled for "
                      "the CPU at build (`--ov-device CPU --ov-sizes`). Each step from plain OpenVINO (our export, "
                      "no passes, dynamic shapes) to our default changes one thing. Errors as in the "
                      "precision table: the same 4 prompts and starting latents; int8 is calibrated on 32 prompts x "
                      f"{a.calibration_steps} steps at {a.calibration_size}x{a.calibration_size}.", *notes]})

    def _peer_error(self, reference: Variant, peer: Variant) -> dict:
        """The peer's images against the reference artifact's, both made in their own worker process
        from the same prompts and starting latents (the transformer's error is ours only)."""
        import tempfile

        import numpy as np

        from bench.tables.precision import PROMPTS, psnr

        with tempfile.TemporaryDirectory() as out, running([reference, peer], self.constants, _log) as workers:
            job = {"job": "images", "prompts": list(PROMPTS), "steps": self.args.precision_steps,
                   "height": self.args.size, "width": self.args.size}
            files = [w.ask({**job, "out": str(Path(out) / str(i))})["files"] for i, w in enumerate(workers)]
            pairs = [(np.load(r), np.load(p)) for r, p in zip(*files)]
        return {"psnr_min": min(psnr(r, p) for r, p in pairs),
                "max_abs": max(float(np.abs(r - p).max()) for r, p in pairs),
                "transformer_rel_err": {}, "finite": bool(all(np.isfinite(p).all() for _, p in pairs))}

    def measure_profiling(self):
        """What `profile=` costs end to end, and what the runner costs with it off."""
        if "profiling" not in self.args.tables:
            return
        a, artifact = self.args, str(self.build / "ort-fp32")
        variants = [Variant("ours, without the profiling hook", "ours-without-hook", artifact),
                    Variant("ours, profiling off", "ours", artifact),
                    Variant("ours, profile=DIR", "ours-profiled", artifact)]
        job = {"job": "e2e", "steps": a.profiling_steps, "height": a.size, "width": a.size}
        with running(variants, self.constants, _log) as workers:
            samples = interleaved(workers, job, a.reps, _log)
        rows = [[v.label, f"{st.median:.2f}", ratio]
                for v, st, ratio in _against_first(variants, samples, lambda s: s["seconds"])]
        self.tables.append({
            "title": f"Profiling cost, end to end at {a.size}x{a.size}, {a.profiling_steps} steps (ort-fp32)",
            "columns": ["runner", "median s", "speed vs without the hook"], "rows": rows,
            "notes": ["'Without the profiling hook' replaces `Pipeline.run` by a direct session call, as it was "
                      "before profiling existed; with profiling off the runner's only extra work per engine call "
                      "is one `is None` check. With it on, the call reopens every session with ONNX Runtime's "
                      "profiler (inside the timed call), records each operator, and writes one trace file per "
                      "engine call."]})

    def measure_tiling(self):
        """Peak memory and time of the VAE decode, whole and tiled, each in a fresh process."""
        if "tiling" not in self.args.tables:
            return
        artifact = self.build / "ort-fp32"
        vae = Variant("vae_decoder", "vae-decoder", str(artifact))
        scale = self.constants["vae_scale_factor"]
        hi = read_manifest(artifact, verify=False)["submodules"]["vae_decoder"]["dims"]["latent_height"][2]
        rows = []
        for size in (int(s) for s in self.args.tiling_sizes.split(",")):
            # Tiles of half the engine's largest side when the image fits it whole, else the largest side.
            tile = hi // 2 if size // scale <= hi else hi
            for tiling in (False, True):
                job = {"job": "vae_decode", "height": size, "width": size, "tiling": tiling, "tile": tile}
                samples, peaks, failed = interleaved_fresh([vae], self.constants, job, 1, _log)
                label = f"tiled, {tile * scale}-px tiles" if tiling else "whole"
                if failed:
                    rows.append([f"{size}x{size}", label, "failed", failed[vae.label].split(": ", 1)[1]])
                else:
                    rows.append([f"{size}x{size}", label, f"{samples[vae.label][0]['seconds']:.1f}",
                                 f"{peaks[vae.label]:.0f}"])
        self.tables.append({
            "title": "VAE decode, whole and tiled (ort-fp32)",
            "columns": ["image", "decode", "seconds", "peak RSS MiB"], "rows": rows,
            "notes": [f"The decoder engine was built for latents up to {hi} ({hi * scale} px). One run each, every "
                      "one in a fresh process that loads only the VAE decoder (`Pipeline.load(..., "
                      "submodules=['vae_decoder'])`): peak RSS is that process's. A whole decode past that range "
                      "calls the engine directly (the runner would tile it): ONNX Runtime accepts any size, so this "
                      "row shows what decoding it whole would take."]})

    def measure_copies(self):
        if "copies" in self.args.tables:
            from bench.tables.copies import copies_table

            self.tables.append(copies_table(self.build / "ort-fp32", self.constants, self.args.size, self.args.reps))

    def measure_memory(self):
        """--memory-submodules at --memory-size and --memory-batch: ONNX Runtime's defaults on the
        plain export and on the default artifact, against the --memory artifact with and without
        remat, every run in a fresh process; and the analyzer's planned peak against the RSS
        increase measured with buffer reuse and the arena off."""
        if "memory" not in self.args.tables:
            return
        from bench.tables.memory import graph_gflops, graph_without, planned_peak_mib, run_once
        from bench.prepare import build_memory
        from export.shapes import concrete

        artifact = in_child(build_memory, self.build)
        built = read_manifest(artifact, verify=False)
        manifest = built["submodules"]
        size, batch, scale = self.args.memory_size, self.args.memory_batch, self.constants["vae_scale_factor"]
        dims = {"batch": batch, "latent_height": size // scale, "latent_width": size // scale,
                "image_height": size, "image_width": size}
        names = self.args.memory_submodules.split(",")
        rows = []
        med = statistics.median
        for name in names:
            sub = manifest[name]
            inputs = {t["name"]: concrete(tuple(t["shape"]), dims, self.constants) for t in sub["inputs"]}
            weights = sum(f.stat().st_size for f in self.onnx_dir.glob(f"{name}.onnx*")) / 2**20
            config, options = sub.get("session_config", {}), sub.get("session_options", {})
            no_reuse = {**options, "enable_cpu_mem_arena": False, "enable_mem_reuse": False}
            no_layout = {**no_reuse, "disabled_optimizers": options.get("disabled_optimizers", []) + ["NchwcTransformer"]}
            graphs = {"plain": str(self.onnx_dir / f"{name}.onnx"),
                      "default": str(self.default_artifact / manifest[name]["file"])}
            remat = next((p for p in sub["passes"] if p["name"] == "remat"), None)
            if remat and remat["modified"]:
                graphs["no_remat"] = in_child(graph_without, self.onnx_dir, artifact, name, "remat",
                                              self.build / "bench-memory-no-remat")
            graphs["memory"] = str(artifact / sub["file"])
            settings = {"plain": (None, None), "default": (None, None), "no_remat": (config, options),
                        "memory": (config, options)}
            labels = {"plain": "plain export, ONNX Runtime defaults",
                      "default": f"{self.default_artifact.name} (fusions), ONNX Runtime defaults",
                      "no_remat": f"{artifact.name} without remat, its manifest's settings",
                      "memory": f"{artifact.name}, its manifest's settings"}
            # The static figures first: a failure here costs seconds, not the runs' minutes.
            planned = {key: in_child(planned_peak_mib, Path(path), dims) for key, path in graphs.items()}
            gflops = {key: in_child(graph_gflops, path, dims) for key, path in graphs.items()}
            runs = {key: [] for key in graphs}
            for rep in range(self.args.reps):  # interleaved, each in a fresh process
                for key, path in graphs.items():
                    runs[key].append(in_child(run_once, path, inputs, *settings[key]))
                _log(f"memory {name} {size}x{size} batch {batch}: {rep + 1}/{self.args.reps}")
            check = {"reuse and arena off": in_child(run_once, graphs["memory"], inputs, config, no_reuse),
                     "reuse, arena and NCHWc layout off": in_child(run_once, graphs["memory"], inputs, config,
                                                                    no_layout)}
            ref = med([r["peak_mib"] for r in runs["default"]])
            for key in graphs:
                peak, sec = med([r["peak_mib"] for r in runs[key]]), med([r["seconds"] for r in runs[key]])
                rows.append([name, labels[key], f"{peak:.0f}", f"{peak - weights:.0f}",
                             f"{(peak - weights) / (ref - weights):.2f}", f"{sec:.1f}",
                             f"{gflops[key]:.0f} ({gflops[key] / gflops['default'] - 1:+.1%})",
                             f"{planned[key]:.0f}", "-"])
            for label, r in check.items():
                rows.append([name, f"{artifact.name}, {label}", f"{r['peak_mib']:.0f}", f"{r['peak_mib'] - weights:.0f}",
                             "-", f"{r['seconds']:.1f}", "-", f"{planned['memory']:.0f}",
                             f"{r['increase_mib']:.0f} ({r['increase_mib'] / planned['memory'] - 1:+.0%})"])
        passes = {n: [p for p in manifest[n]["passes"] if p["name"] in built["memory"]["passes"]] for n in names}
        self.tables.append({
            "title": f"Activation memory: {', '.join(names)} of {self.src.entry.name} at {size}x{size}, batch {batch} (fp32)",
            "columns": ["submodule", "graph and session", "peak RSS MiB", "above the weights MiB",
                        f"vs {self.default_artifact.name}", "seconds", "GFLOP (vs fusions)",
                        "analyzer's planned peak MiB", "measured RSS increase MiB (vs planned)"],
            "rows": rows,
            "notes": [f"Medians of {self.args.reps} runs, each in a fresh process that loads one graph and runs it once; "
                      "peak RSS is that process's VmHWM (weights and ONNX Runtime's prepacked copies included). "
                      "'Above the weights' is that peak minus the bytes of the exported weights file(s): the "
                      "activations and whatever ONNX Runtime allocates besides. The increase is VmHWM minus the RSS "
                      "just before the call. The analyzer plans the graph's file order (ONNX Runtime's default "
                      "order may differ on the plain export).",
                      "Memory passes as the artifact's manifest records them: " + "; ".join(
                          f"{n}: " + _what_changed(ps) for n, ps in passes.items()),
                      "Session settings of the artifact: " + "; ".join(
                          f"{n}: {manifest[n].get('session_options', {})}" for n in names)]})

    def measure_serving(self):
        if "serving" in self.args.tables:
            from bench.tables.serving import serving_table

            a = self.args
            clients = [int(c) for c in a.serving_clients.split(",")]
            self.tables.append(serving_table(self.default_artifact, a.serving_size, a.serving_steps,
                                             a.serving_requests, clients, _log))

    def measure_lora(self):
        if "lora" in self.args.tables:
            from bench.tables.lora import lora_table

            a = self.args
            self.tables.append(lora_table(self.build, self.src.folder, a.size, a.lora_steps, a.reps, _log))

    def export_table(self):
        if "export" not in self.args.tables:
            return
        built = {a.name: read_manifest(a, verify=False)["submodules"] for a in self.artifacts}
        rows = [[name, f"{sub['export']['export_seconds']:.1f}", f"{sub['export']['seconds_with_checks']:.1f}",
                 f"{sub['export']['bytes'] / 2**20:.0f}", *(f"{built[a][name]['build_seconds']:.1f}" for a in built)]
                for name, sub in self.onnx_manifest["submodules"].items()]
        notes = []
        if self.optimum_seconds is not None:
            notes.append(f"Optimum-ONNX's export of the same folder (`optimum-cli export onnx --task text-to-image`, "
                         f"legacy exporter, with its own validation) took {self.optimum_seconds:.0f} s.")
        self.tables.append({"title": "Export and build, seconds (recorded in the manifests by the run that built them)",
                            "columns": ["submodule", "export", "export + parity at 2 shapes", "MiB",
                                        *(f"build {a}" for a in built)], "rows": rows, "notes": notes})

    def write(self):
        from export.versions import package_versions

        report = {"command": self.command, "model": self.src.entry.name, "description": self.src.entry.description,
                  "versions": package_versions(("torch", "diffusers", "transformers", "onnxruntime")),
                  "reps": self.args.reps, "gemm": self.gemm, "tables": self.tables,
                  "minutes": (time.perf_counter() - self.started) / 60}
        out = Path(self.args.out)
        previous = out.read_text() if out.exists() else ""
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(render(report, previous))
        tmp.replace(out)
        _log(f"wrote {self.args.out}")


def _accuracy_cells(err: dict) -> list[str]:
    """Image PSNR, image max abs, transformer rel. errors, all finite: of one variant's entry in
    bench.tables.precision.accuracy's result ({} for a variant it did not run)."""
    cells = ["-"] * 3 + [("yes" if err["finite"] else "NO") if err else "-"]
    if "psnr_min" in err:
        cells[:3] = [f"{err['psnr_min']:.1f}", f"{err['max_abs']:.1e}",
                     ", ".join(f"{e:.1e}" for e in err["transformer_rel_err"].values()) or "-"]
    elif err:
        cells[0] = "reference"
    return cells


def _against_first(variants: list[Variant], samples: dict, key) -> list[tuple]:
    """(variant, Stat, ratio text) for each variant, the first one being the reference."""
    ref = [key(s) for s in samples[variants[0].label]]
    out = []
    for v in variants:
        first = v is variants[0]
        st = stats([key(s) for s in samples[v.label]], None if first else ref)
        out.append((v, st, "1 (reference)" if first else st.ratio_text()))
    return out


def _what_changed(reports: list[dict]) -> str:
    done = [f"{r['name']}: " + ", ".join(f"{k} {v}" for k, v in r["counts"].items() if v)
            for r in reports if r["modified"]]
    return "; ".join(done) or "nothing (no passes)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench = Bench(_parse(argv), "python -m bench " + " ".join(map(shlex.quote, argv)))
    for stage in (bench.prepare, bench.measure_gemm, bench.measure, bench.measure_passes, bench.profile,
                  bench.measure_precision, bench.measure_openvino, bench.measure_profiling, bench.measure_tiling,
                  bench.measure_copies, bench.measure_memory, bench.measure_serving, bench.measure_lora, bench.export_table,
                  bench.write):
        _log(f"{stage.__name__} ({time.perf_counter() - bench.started:.0f} s in)")
        stage()
    return 0


if __name__ == "__main__":
    sys.exit(main())
