"""python -m engines inspect PATH: what each graph of an export (PATH/onnx or PATH holding
manifest.json) or ONNX Runtime artifact holds while it runs, one row per submodule.

Columns: parameters, FLOPs (2 x multiply-adds), weight bytes, the planned activation peak under
the node order and in-place rules ONNX Runtime will use, the bytes moved off-chip when only
`--sram` fits on chip, and the largest tensors live at the peak. `--plot` draws live bytes over
the schedule before and after the memory passes. Shapes: the export's opt dims, with `--height`,
`--width` (pixels) and `--batch` replacing the batch and every dim that follows the image size.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engines.memory.graph import graph_of
from engines.memory.planner import plan
from engines.memory.sizes import format_size, parse_size
from runners.static import StaticRequest

TOP = 5


def _folder(path: Path) -> Path:
    for folder in (path, path / "onnx"):
        if (folder / "manifest.json").exists():
            return folder
    raise ValueError(f"{path} holds no manifest.json: give an export's build folder, its onnx/ folder or an artifact")


def inspect_dims(manifest: dict, height: int | None, width: int | None, batch: int | None) -> dict[str, int]:
    """The dims to analyse at: the export's opt values, with the image size and batch replaced."""
    constants = manifest.get("constants", {})
    dims = {**constants, **{d: v[1] for d, v in manifest["dims"].items()}}
    scale = constants.get("vae_scale_factor", 8)
    for axis, pixels in (("height", height), ("width", width)):
        if pixels is not None and pixels % scale:
            raise ValueError(f"--{axis} {pixels} is not a multiple of the VAE's scale factor {scale}")
    if height is not None or width is not None:  # every dim that follows the size: latents, image tokens, ...
        size = StaticRequest(height or dims["image_height"], width or dims["image_width"])
        sized = size.dims(manifest["pipeline"]["denoiser"], manifest["pipeline"])
        dims.update({d: v for d, v in sized.items() if d != "batch"})
    if batch is not None:
        dims["batch"] = batch
    return dims


def inspect_submodule(path: Path, dims: dict, sram: int, with_passes: bool, budget: int | None) -> dict:
    """One row of the table; with `with_passes`, the live bytes after the memory passes too."""
    from runners.manifest import load_onnx

    model = load_onnx(path)
    graph = graph_of(model, dims)
    p = plan(graph)
    at_peak = p.live_at(p.peak_step)[:TOP]
    row = {
        "parameters": graph.parameters, "flops": sum(graph.flops), "weight_bytes": sum(graph.weights.values()),
        "peak_bytes": p.peak, "peak_node": graph.nodes[p.order[p.peak_step]].name,
        "offchip_bytes": p.offchip_bytes(sram), "sram": sram,
        "largest_at_peak": [{"tensor": b.tensor, "bytes": b.nbytes,
                             "from": "graph input" if b.writer is None else graph.nodes[b.writer].name,
                             "until": graph.nodes[p.order[min(b.end, len(p.order) - 1)]].name} for b in at_peak],
        "unknown_shapes": len(graph.unknown), "live": p.live,
    }
    if with_passes:
        from engines.passes import PassContext, run_passes
        from engines.targets import get_target

        passes = get_target("ort", "fp32").memory.passes  # the graphs analysed are ONNX Runtime's
        model, _ = run_passes(model, passes, context=PassContext(dims=dims, memory_budget=budget))
        after = plan(graph_of(model, dims))
        row.update(peak_after_passes=after.peak, live_after_passes=after.live)
    return row


def inspect(path: Path, height=None, width=None, batch=None, sram: int = 8 * 2**20, with_passes=False,
            budget: int | None = None, log=None) -> dict:
    """{submodule: row} for every ONNX graph in the folder (TensorRT engines are skipped: inspect the
    export's onnx/ folder for them)."""
    folder = _folder(Path(path))
    manifest = json.loads((folder / "manifest.json").read_text())
    dims = inspect_dims(manifest, height, width, batch)
    rows = {}
    for name, entry in manifest["submodules"].items():
        if not entry["file"].endswith(".onnx"):
            continue
        if log:
            log(f"analysing {name}")
        rows[name] = inspect_submodule(folder / entry["file"], dims, sram, with_passes, budget)
    return {"folder": str(folder), "dims": dims, "submodules": rows}


def format_table(result: dict) -> str:
    rows = result["submodules"]
    sram = format_size(next(iter(rows.values()))["sram"]) if rows else "-"
    after = any("peak_after_passes" in r for r in rows.values())
    head = ["submodule", "parameters", "GFLOPs", "weights", "activation peak"] + \
        (["after memory passes"] if after else []) + [f"off-chip past {sram} SRAM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        cells = [name, f"{r['parameters'] / 1e6:.1f} M", f"{r['flops'] / 1e9:.1f}", format_size(r["weight_bytes"]),
                 format_size(r["peak_bytes"])] + ([format_size(r["peak_after_passes"])] if after else []) + \
            [format_size(r["offchip_bytes"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, r in rows.items():
        lines.append(f"{name}: at the peak (node {r['peak_node']}):")
        if r["unknown_shapes"]:
            lines.append(f"  ({r['unknown_shapes']} tensors of unresolved shape, counted at their first input's size)")
        lines += [f"  {format_size(t['bytes']):>10}  {t['tensor']}  (from {t['from']}, held until {t['until']})"
                  for t in r["largest_at_peak"]]
    dims = ", ".join(f"{k}={v}" for k, v in result["dims"].items() if k.startswith(("image_", "latent_h", "latent_w", "batch")))
    return "\n".join([f"{result['folder']} at {dims}", ""] + lines)


def plot(result: dict, path: Path, budget: int | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    rows = result["submodules"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.6 * len(rows)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], rows.items()):
        ax.plot([b / 2**20 for b in r["live"]], label="as given")
        if "live_after_passes" in r:
            ax.plot([b / 2**20 for b in r["live_after_passes"]], label="after the memory passes")
        if budget:
            ax.axhline(budget / 2**20, color="red", linestyle="--", label="budget")
        ax.set_title(name)
        ax.set_ylabel("live MiB")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("node in execution order")
    fig.tight_layout()
    partial = path.with_name(f".{path.name}.partial.png")  # a failure or Ctrl-C leaves no half-written plot
    fig.savefig(partial)
    partial.replace(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="a build folder, its onnx/ folder, or an ONNX Runtime artifact")
    p.add_argument("--height", type=int, help="image height in pixels (default: the export's opt)")
    p.add_argument("--width", type=int, help="image width in pixels (default: the export's opt)")
    p.add_argument("--batch", type=int, help="batch (default: the export's opt)")
    p.add_argument("--sram", default="8MiB", help="on-chip memory for the off-chip column (default: %(default)s)")
    p.add_argument("--passes", action="store_true", help="also plan each graph after the memory passes")
    p.add_argument("--memory-budget", default=None, metavar="SIZE", help="remat's budget with --passes; a line on --plot")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (live-byte curves left out)")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="live bytes over the schedule (implies --passes)")
    args = p.parse_args(argv)

    from runners.cli import run_cli

    def run():
        budget = parse_size(args.memory_budget) if args.memory_budget else None
        result = inspect(args.path, args.height, args.width, args.batch, parse_size(args.sram),
                         args.passes or args.plot is not None, budget, log=lambda m: print(m, file=sys.stderr))
        if args.plot:
            plot(result, args.plot, budget)
        for r in result["submodules"].values():
            r.pop("live"), r.pop("live_after_passes", None)
        print(json.dumps(result, indent=1) if args.json else format_table(result))

    return run_cli(run, (ValueError, OSError), "nothing was inspected")
