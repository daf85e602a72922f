"""Export and build seconds of every submodule, as the manifests of the run that built them
record them: the export, and each artifact of the model's build folder."""
from __future__ import annotations

from bench.tables import Table
from runners.manifest import read_manifest


def measure(run) -> list[dict]:
    # Hidden folders are a build's temporary or replaced ones (runners.manifest.atomic_folder).
    artifacts = sorted(d for d in run.build.iterdir() if d.is_dir() and not d.name.startswith(".")
                       and d.name not in ("onnx", "optimum") and (d / "manifest.json").exists())
    built = {a.name: read_manifest(a, verify=False)["submodules"] for a in artifacts}
    rows = [[name, sub["export"].get("trace_of", "its own"), f"{sub['export']['export_seconds']:.1f}",
             f"{sub['export']['seconds_with_checks']:.1f}", f"{sub['export']['bytes'] / 2**20:.0f}",
             *(f"{built[a][name]['build_seconds']:.1f}" if name in built[a] else "-" for a in built)]
            for name, sub in run.onnx_manifest["submodules"].items()]
    notes = []
    if run.optimum_seconds is not None:
        notes.append(f"Optimum-ONNX's export of the same folder (`optimum-cli export onnx --task text-to-image`, "
                     f"legacy exporter, with its own validation) took {run.optimum_seconds:.0f} s.")
    return [{"title": "Export and build, seconds (recorded in the manifests by the run that built them)",
             "columns": ["submodule", "trace", "export", "export + parity at 2 shapes", "MiB",
                         *(f"build {a}" for a in built)],
             "rows": rows, "notes": ["Trace: the graph's own, another graph's of the export (cut from it, or a "
                                     "component of the same architecture), or the trace cache's (an earlier export "
                                     "of the same architecture): only a graph traced here pays for tracing.", *notes]}]


TABLE = Table("export", "Export and build", "nothing", ("sd3", "sd15", "sdxl"), measure)
