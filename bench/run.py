"""What every table of one `python -m bench` run shares: the model's export and default artifact
(built once, cached), the peers that run the same weights, and this run's fp32 GEMM rates (the
FLOP bound). Tables read the model's submodules and call shapes from here, never from constants
of one family."""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path

from bench import workload
from bench.harness import Variant, in_prepared_child, log
from bench.prepare import build_reference, export_build
from runners.manifest import read_manifest


@dataclass
class Run:
    args: argparse.Namespace
    src: object  # export.source.ModelSource
    build: Path  # holds onnx/ and the artifacts
    onnx_manifest: dict
    peers: list[Variant]  # diffusers eager first (the reference of every speed-up), then the peers
    gemm: dict[str, float]  # GFLOP/s by library
    optimum_folder: Path | None = None
    optimum_seconds: float | None = None

    @property
    def onnx_dir(self) -> Path:
        return self.build / "onnx"

    @property
    def constants(self) -> dict:
        return self.onnx_manifest["constants"]

    @functools.cached_property
    def default_artifact(self) -> Path:
        """The reference artifact, built (or found up to date) at its first use: a table of other artifacts
        does not build it (sd3-fullsize's ort-fp16 is 17 GB)."""
        return Path(in_prepared_child(build_reference, self.build))

    @functools.cached_property
    def variants(self) -> list[Variant]:
        """The peers, then ours: the reference artifact."""
        return [*self.peers, Variant(f"(d) ours {self.default_artifact.name}", "ours", str(self.default_artifact))]

    @property
    def rate(self) -> float:
        """The best fp32 GEMM rate of this run, FLOP/s: the FLOP bound of every latency."""
        return max(self.gemm.values()) * 1e9

    @property
    def denoiser(self) -> str:
        return workload.denoiser(self.onnx_manifest)

    def dims(self, size: int, submodule: str) -> dict[str, int]:
        batch = workload.DENOISER_BATCH if submodule == self.denoiser else 1
        return workload.call_dims(self.src, self.constants, size, batch)

    def inputs(self, size: int, names: list[str] | None = None) -> dict:
        """Input specs of one call of each of `names` (default: the text-to-image submodules)."""
        return workload.input_specs(self.src, self.onnx_manifest, size, names or workload.text_to_image(self.onnx_manifest))

    def flops(self, size: int) -> dict[str, int]:
        """MatMul, Gemm and Conv FLOPs of one call of each text-to-image submodule at `size`."""
        from engines.memory.graph import graph_flops

        return {n: graph_flops(self.onnx_dir / f"{n}.onnx", self.dims(size, n))
                for n in workload.text_to_image(self.onnx_manifest)}


def prepare(args: argparse.Namespace) -> Run:
    """Export (cached, in a child process), Optimum's export when asked for, and this run's GEMM rates."""
    from bench.gemm import gemm_gflops
    from export.source import resolve

    build = in_prepared_child(export_build, args.model, Path(args.build_dir))
    src = resolve(args.model)  # built by the child: only read here
    manifest = read_manifest(build / "onnx", verify=False)  # export_model just verified it
    run = Run(args, src, build, manifest, [Variant("(a) diffusers eager", "diffusers", str(src.folder))], {})
    if args.compile:
        run.peers.append(Variant("(b) diffusers torch.compile", "diffusers-compile", str(src.folder)))
    if args.optimum_python:
        from bench.optimum import optimum_export

        run.optimum_folder, run.optimum_seconds = optimum_export(args.optimum_python, src.folder, build, log)
        run.peers.append(Variant("(c) optimum-onnx", "optimum", str(run.optimum_folder), args.optimum_python))
    log("measuring fp32 GEMM throughput")
    run.gemm = gemm_gflops(args.gemm_size)
    return run
