"""The OpenVINO peer: optimum-intel's export of the same pipeline folder, run by its own
OVStableDiffusion3Pipeline (bench.variants.OptimumIntel) in the openvino table. optimum-intel
pins transformers < 5.6 and declares torchvision (whose registry wheel pulls a CUDA torch), so it
lives in .venv-optimum-intel (the Makefile's `optimum-intel-venv` target).

Unlike Optimum-ONNX (bench/optimum.py), it runs transformers 5, which reads the folder as we
save it: it exports the source folder itself, without a rewritten copy.
"""
from __future__ import annotations

from pathlib import Path

from bench.harness import Variant, log
from bench.optimum import export_once, timed_cli


def optimum_intel_export(python: str, src: Path, build: Path, log, task: str = "text-to-image") -> tuple[Path, float]:
    """Export `src` with optimum-cli into build/optimum-intel (once); returns the folder and export seconds."""
    def export(tmp: Path):
        cli = str(Path(python).parent / "optimum-cli")
        argv = [cli, "export", "openvino", "--model", str(src), "--task", task, str(tmp / "openvino")]
        return tmp / "openvino", timed_cli(argv, log)

    return export_once(build, "optimum-intel", log, export)


# optimum-cli's task and openvino.genai's pipeline (its variant kind) by what the table's rows make; editing from a
# reference image is its Image2ImagePipeline on the text to image export (FLUX.2 klein's takes the image as reference
# tokens, as Flux2KleinPipeline does)
PEER_TASKS = {"text to image": ("text-to-image", "Text2ImagePipeline", "genai"),
              "text to video": ("text-to-video", "Text2VideoPipeline", "genai-video"),
              "editing": ("text-to-image", "Image2ImagePipeline", "genai-edit")}


def genai_export(export: Path, build: Path, renames: dict[str, dict[str, str]]) -> Path:
    """optimum-intel's `export` as openvino.genai runs it: as it is, or, made once in build/optimum-intel-genai, with
    the outputs `renames` names renamed ({component: {name: new name}}) and every other file linked."""
    if not renames:
        return export

    def relabel(tmp: Path) -> tuple[Path, float]:
        import openvino

        out = tmp / export.name
        for component, names in renames.items():
            (out / component).mkdir(parents=True)
            model = openvino.Core().read_model(export / component / "openvino_model.xml")
            for name, new in names.items():
                model.output(name).get_tensor().set_names({new})
            openvino.save_model(model, out / component / "openvino_model.xml", compress_to_fp16=False)
        for part in [*export.iterdir(), *(f for c in renames for f in (export / c).iterdir())]:
            if not (out / part.relative_to(export)).exists():
                (out / part.relative_to(export)).symlink_to(part.resolve())
        return out, 0.0

    return export_once(build, "optimum-intel-genai", log, relabel)[0]


def openvino_peers(run, pipeline: str, kind: str, genai_rows: list[tuple[str, dict]], task: str = "text to image",
                   genai_renames=lambda export: {}) -> tuple[list[Variant], list[str]]:
    """A family table's OpenVINO peers and notes on them: optimum-intel's `pipeline` (a variant of `kind`) on its
    own export of the run's model, then openvino.genai's pipeline of the `task` on that export (with the outputs
    `genai_renames`(export) names renamed: genai_export), a row per (label, options) of `genai_rows`; none, with a
    note saying why, without --optimum-intel-python."""
    python = run.args.optimum_intel_python
    if not python:
        return [], ["The optimum-intel and openvino.genai rows are not run: they need --optimum-intel-python "
                    "(`make optimum-intel-venv`)."]
    cli_task, genai, genai_kind = PEER_TASKS[task]
    folder, seconds = optimum_intel_export(python, run.src.folder, run.build, log, cli_task)
    variants = [Variant(f"optimum-intel {pipeline}, its defaults", kind, str(folder), python)]
    genai_folder = genai_export(folder, run.build, genai_renames(folder))
    variants += [Variant(f"openvino.genai {genai}, {label}", genai_kind, str(genai_folder), python, options)
                 for label, options in genai_rows]
    relabelled = "" if genai_folder == folder else f" ({genai_folder.parent.name}: its output names as it reads them)"
    return variants, [f"optimum-intel's export (`optimum-cli export openvino --task {cli_task}`, its defaults) "
                      f"took {seconds:.0f} s; openvino.genai runs the same export{relabelled}."]
