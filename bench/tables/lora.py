"""The LoRA table: one adapter on the transformer applied to the built artifact (`python -m engines
lora`) against exporting and building it again; switching adapters at run time; and the denoising
step with and without an adapter, switched in at run time or applied offline, on ort-fp32 and ort-int8;
and on openvino-bf16 and -int8, the two OpenVINO designs (adapted constants compiled again, or
low-rank branches switched)."""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import in_child, in_prepared_child, log, stats, timed_calls
from bench.tables import Table

ATTENTION = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "attn.to_out.0.weight")


def make_adapter(checkpoint_folder: Path, out: Path, rank: int = 16, seed: int = 0) -> Path:
    """A random diffusers-format adapter (rank `rank`, alpha = rank) on every attention projection
    of the transformer, the layers SD3 LoRA training scripts adapt by default."""
    from safetensors.numpy import save_file

    from export.lazy_weights import checkpoint_index

    rng = np.random.default_rng(seed)
    tensors = {}
    for key, entry in checkpoint_index(checkpoint_folder).items():
        if key.endswith(ATTENTION):
            module = key[:-len(".weight")]
            rows, cols = entry["shape"]
            tensors[f"transformer.{module}.lora_A.weight"] = rng.standard_normal((rank, cols), np.float32) / cols ** 0.5
            tensors[f"transformer.{module}.lora_B.weight"] = rng.standard_normal((rows, rank), np.float32) * 0.01
    metadata = {"lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": rank})}
    save_file(tensors, str(out), metadata=metadata)
    return out


def _steps(artifact: str, loras: dict, offline: str, size: int, steps: int, reps: int) -> dict:
    """In a fresh process: the apply, switch and per-step times."""
    from engines.lora import apply_loras
    from runners import Pipeline

    kwargs = dict(prompt="a photo of a cat", height=size, width=size, num_inference_steps=steps, seed=0,
                  output_type="latent")
    applies = []
    for i in range(reps):
        t0 = time.perf_counter()
        apply_loras(artifact, loras, Path(offline) / f"a{i}")
        applies.append(time.perf_counter() - t0)
    pipes = {"no adapter": Pipeline.load(artifact), "adapter switched in (set_loras)": Pipeline.load(artifact),
             "adapter applied offline": Pipeline.load(Path(offline) / "a0")}
    switches = []
    for _ in range(reps):  # switching in and out: each one reopens the transformer with or without it
        for target in (loras, {}):
            t0 = time.perf_counter()
            pipes["adapter switched in (set_loras)"].set_loras(target)
            switches.append(time.perf_counter() - t0)
    pipes["adapter switched in (set_loras)"].set_loras(loras)
    step = {label: [] for label in pipes}
    for pipe in pipes.values():
        pipe(**kwargs)  # warm-up
    for _ in range(reps):  # interleaved, so that drift in the machine's speed reaches every variant alike
        for label, pipe in pipes.items():
            pipe(**kwargs)
            step[label].append(pipe.timings["denoise"] / steps)
    return {"apply": applies, "switch": switches, "step": step}


def _designs(artifact: str, loras: dict, scratch: str, size: int, reps: int) -> dict:
    """In a fresh process, one transformer call (the pipeline's first, recorded) by three sessions:
    no adapter; design 1, the adapted weights as initializer overrides of a reopened session (what
    `set_loras` does); design 2, the adapted weights as graph inputs, bound once (IOBinding), so that
    a switch rebinds them without reopening. Returns switch and call seconds."""
    import onnx_ir as ir
    import onnxruntime as ort

    from runners import Pipeline
    from runners.backends.ort import OrtSession
    from runners.adapters.lora import adapted_submodules
    from runners.manifest import read_manifest

    artifact, scratch = Path(artifact), Path(scratch)
    calls = []
    with Pipeline.load(artifact) as pipe:
        pipe.recorder = lambda sub, feeds: calls.append(dict(feeds)) if sub == "transformer" else None
        pipe("a photo of a cat", height=size, width=size, num_inference_steps=1, seed=0, output_type="latent")
    feeds = calls[0]
    manifest = read_manifest(artifact, verify=False)
    t0 = time.perf_counter()
    adapted = adapted_submodules(artifact, manifest, loras)["transformer"]
    compute = time.perf_counter() - t0
    model = ir.load(artifact / "transformer.onnx")
    for name in adapted:  # an initializer that is also a graph input: a fed value replaces it
        model.graph.inputs.append(model.graph.initializers[name])
    # The weights stay in the artifact's file (linked here): the graph refers to it by name.
    (scratch / "designs").mkdir()
    os.link(artifact / "transformer.onnx.data", scratch / "designs" / "transformer.onnx.data")
    ir.save(model, scratch / "designs" / "inputs.onnx")
    del model
    base = OrtSession(artifact / "transformer.onnx")
    t0 = time.perf_counter()
    overrides = OrtSession(artifact / "transformer.onnx", initializers=adapted)
    open_seconds = time.perf_counter() - t0
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3  # its warning that the weights it is fed are not constants is the point
    inputs = ort.InferenceSession(str(scratch / "designs" / "inputs.onnx"), quiet, providers=["CPUExecutionProvider"])
    binding = inputs.io_binding()
    t0 = time.perf_counter()
    bound = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in adapted.items()}
    for name, value in bound.items():
        binding.bind_ortvalue_input(name, value)
    bind_seconds = time.perf_counter() - t0
    outputs = [o.name for o in inputs.get_outputs()]

    def run_bound():
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in outputs:
            binding.bind_output(name)
        inputs.run_with_iobinding(binding)

    runs = {"no adapter": lambda: base.run(feeds), "design 1: overrides, session reopened": lambda: overrides.run(feeds),
            "design 2: graph inputs, bound once": run_bound}
    times = timed_calls(runs, reps)
    return {"compute": compute, "switch": {"design 1: overrides, session reopened": compute + open_seconds,
                                           "design 2: graph inputs, bound once": compute + bind_seconds},
            "call": times}


def _replace_constants(model, factors: dict) -> None:
    """OpenVINO design (a), timed here only: each adapted layer's weight constant replaced by the
    adapted one (the branch factors' A @ B added in the constant's layout). int8 weights refuse."""
    import openvino as ov

    ops = {op.get_friendly_name(): op for op in model.get_ops()}
    for name, (a, b) in factors.items():
        matmul = ops[name]
        node = matmul.input(1).get_source_output().get_node()
        if node.get_type_name() == "Convert":  # weights stored in f16
            node = node.input(0).get_source_output().get_node()
        if node.get_type_name() != "Constant" or node.get_element_type() not in (ov.Type.f32, ov.Type.f16):
            raise ValueError(f"{name}: its weight is not a float constant (int8 would need requantizing)")
        weight = node.get_data().astype(np.float32)
        change = a @ b
        weight += change.T if matmul.get_attributes()["transpose_b"] else change
        node.output(0).replace(ov.opset13.constant(weight.astype(node.get_data().dtype)).output(0))


def _openvino_designs(artifact: str, loras: dict, size: int, reps: int) -> dict:
    """In a fresh process, one transformer call (the pipeline's first, recorded) of an OpenVINO
    artifact: without an adapter; design (b), the branches (`set_loras`' way), switched by their
    inputs; design (a), the adapted constants in the IR, compiled again. Switch and call seconds."""
    import openvino as ov

    from runners import Pipeline
    from runners.backends.openvino import OpenVinoSession
    from runners.adapters.lora import submodule_tables
    from runners.adapters.branches import branch_factors, branch_layers
    from runners.manifest import read_manifest

    artifact = Path(artifact)
    calls = []
    with Pipeline.load(artifact) as pipe:
        pipe.recorder = lambda sub, feeds: calls.append(dict(feeds)) if sub == "transformer" else None
        pipe("a photo of a cat", height=size, width=size, num_inference_steps=1, seed=0, output_type="latent")
    feeds, manifest = calls[0], read_manifest(artifact, verify=False)
    sub = manifest["submodules"]["transformer"]
    options = dict(session_config=sub["session_config"], session_options={**sub["session_options"], "shapes": "dynamic"})
    layers = branch_layers(submodule_tables(artifact, {"submodules": {"transformer": sub}})["transformer"])

    def factors():
        return branch_factors(artifact, manifest, loras)["transformer"]

    t0 = time.perf_counter()
    first = factors()
    compute = time.perf_counter() - t0
    plain = OpenVinoSession(artifact / sub["file"], **options)
    branched = OpenVinoSession(artifact / sub["file"], lora_layers=layers, lora_factors={}, **options)
    switches = {"(b) branches, inputs switched": [], "(a) constants replaced, compiled again": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        branched.set_lora_factors(factors())
        switches["(b) branches, inputs switched"].append(time.perf_counter() - t0)
        branched.set_lora_factors({})
    branched.set_lora_factors(first)
    core, replaced = ov.Core(), None
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            model = core.read_model(artifact / sub["file"])
            _replace_constants(model, factors())
            replaced = core.compile_model(model, "CPU", sub["session_config"]).create_infer_request()
            switches["(a) constants replaced, compiled again"].append(time.perf_counter() - t0)
    except ValueError as e:
        switches["(a) constants replaced, compiled again"] = str(e)
    runs = {"no adapter": lambda: plain.run(feeds), "(b) branches, inputs switched": lambda: branched.run(feeds)}
    if replaced is not None:
        runs["(a) constants replaced, compiled again"] = lambda: replaced.infer(feeds)
    return {"compute": compute, "switch": switches, "call": timed_calls(runs, reps)}


def _call_rows(what: str, got: dict, computing: str) -> list[list[str]]:
    """A design table's rows: each design's call against the call without an adapter, and its switch
    (seconds, or their list: the median)."""
    base, rows = got["call"]["no adapter"], []
    for label, times in got["call"].items():
        st = stats(times, None if label == "no adapter" else base)
        switch = got["switch"].get(label)
        switch = statistics.median(switch) if isinstance(switch, list) else switch
        rows.append([f"{what}, {label}", f"{st.median:.3f}", "reference" if switch is None else
                     f"speed vs no adapter {st.ratio_text()}; a switch {switch:.3f} s ({got['compute']:.3f} s of it "
                     f"computing {computing})"])
    return rows


def _openvino_rows(run, adapter: Path) -> list[list[str]]:
    """The two OpenVINO designs on openvino-bf16 and -int8 (built as the openvino table builds them)."""
    from bench.accuracy import calibration
    from bench.tables.openvino import build_openvino

    a = run.args
    built = in_prepared_child(build_openvino, run.build, calibration(a), a.size, a.lora_openvino.split(","))
    rows = []
    for label, artifact in built.items():
        log(f"lora: the OpenVINO designs on {label}")
        got = in_child(_openvino_designs, artifact, {str(adapter): 1.0}, a.size, a.reps)
        rows += _call_rows(f"{label} transformer call", got, "A and B")
        refused = got["switch"]["(a) constants replaced, compiled again"]
        if isinstance(refused, str):
            rows.append([f"{label}, (a) constants replaced", "-", refused])
    return rows


def _step_rows(label: str, got: dict) -> list[list[str]]:
    """The run-time switch, and the denoising step of each variant against the step without an adapter."""
    rows = [[f"{label}: switch adapters at run time (`set_loras`, in or out)", f"{statistics.median(got['switch']):.2f}",
             f"range {min(got['switch']):.2f}-{max(got['switch']):.2f} s over {len(got['switch'])} switches"]]
    base = got["step"]["no adapter"]
    for variant, times in got["step"].items():
        st = stats(times, None if variant == "no adapter" else base)
        rows.append([f"{label}: denoising step, {variant}", f"{st.median:.3f}",
                     "reference" if variant == "no adapter" else f"speed vs no adapter {st.ratio_text()}"])
    return rows


def _quantized_rows(run, adapter: Path, scratch: str) -> list[list[str]]:
    """The same adapter on the quantized ONNX Runtime artifacts (built as the precision table builds
    them): applied, switched and stepped, each changed weight quantized again."""
    from bench.accuracy import calibration
    from bench.tables.precision import build_precisions

    a, rows = run.args, []
    precisions = [p for p in a.lora_quantized.split(",") if p]
    built = in_prepared_child(build_precisions, run.build, calibration(a), precisions) if precisions else {}
    for precision, artifact in built.items():
        log(f"lora: applying, switching and stepping on ort-{precision}")
        offline = Path(scratch) / precision
        offline.mkdir()
        got = in_child(_steps, artifact, {str(adapter): 1.0}, str(offline), a.size, a.lora_steps, a.reps)
        rows.append([f"ort-{precision}: apply the adapter (`python -m engines lora`)",
                     f"{statistics.median(got['apply']):.2f}", "each changed weight quantized again"])
        rows += _step_rows(f"ort-{precision}", got)
    return rows


def measure(run) -> list[dict]:
    from runners.manifest import read_manifest

    build, checkpoint, size, steps, reps = run.build, run.src.folder, run.args.size, run.args.lora_steps, run.args.reps
    artifact = build / "ort-fp32"
    export = read_manifest(build / "onnx", verify=False)["submodules"]
    built = read_manifest(artifact, verify=False)["submodules"]
    rebuild_transformer = export["transformer"]["export"]["seconds_with_checks"] + built["transformer"]["build_seconds"]
    rebuild_all = sum(export[n]["export"]["seconds_with_checks"] + built[n]["build_seconds"] for n in export)
    with tempfile.TemporaryDirectory(prefix="bench-lora-", dir=build) as scratch:
        adapter = make_adapter(checkpoint / "transformer", Path(scratch) / "adapter.safetensors")
        log(f"lora: applying, switching and stepping at {size}x{size}, {reps} repetitions")
        got = in_child(_steps, str(artifact), {str(adapter): 1.0}, scratch, size, steps, reps)
        log("lora: the two run-time designs, one transformer call each")
        designs = in_child(_designs, str(artifact), {str(adapter): 1.0}, scratch, size, reps)
        openvino = _openvino_rows(run, adapter) if importlib.util.find_spec("openvino") else []
        quantized = _quantized_rows(run, adapter, scratch)
    apply = statistics.median(got["apply"])
    rows = [["ort-fp32: apply the adapter (`python -m engines lora`)", f"{apply:.2f}",
             f"{apply / rebuild_transformer:.1%} of the transformer's export + build ({rebuild_transformer:.1f} s); "
             f"{apply / rebuild_all:.1%} of the whole pipeline's ({rebuild_all:.1f} s)"]]
    rows += _step_rows("ort-fp32", got) + quantized
    rows += _call_rows("transformer call", designs, "the adapted weights") + openvino
    return [{"title": f"LoRA on a built artifact (ort-fp32; steps at {size}x{size})",
            "columns": ["what", "seconds (median)", "against"],
            "rows": rows,
            "notes": ["The adapter: rank 16 on every attention projection of the transformer (q, k, v, out; "
                      "those fuse_qkv fused are changed in their slices), random weights in diffusers' format. "
                      "The rebuild times are the export (with its parity checks) and build seconds recorded in the "
                      "manifests by the run that built them. Applying writes the adapted weights to a file of their "
                      "own and the transformer's graph; every other file is a hard link. A switch reopens the "
                      "transformer's ONNX Runtime session with the adapted weights given as initializers "
                      "(`SessionOptions.add_initializer`). Step: the denoise stage's seconds over its steps (guidance "
                      f"on, {steps} steps), median of {reps} interleaved runs; the speed ratio's range is over the "
                      "runs. The last rows time one transformer call (the pipeline's first, batch 2) in three sessions "
                      "of one process: `set_loras` is design 1; design 2 would keep one session and rebind the "
                      "weights, at the cost of feeding them as inputs on every call. The ort-int8 rows (and any "
                      "other --lora-quantized precision) apply, switch and step the same adapter on the quantized "
                      "artifact the precision table builds: each weight the adapter changes is dequantized, changed "
                      "and quantized again with its per-channel scales computed afresh (activation scales kept).",
                      "The openvino rows time one transformer call (batch 2) of openvino-bf16 and -int8 in one "
                      "process: (b) is what `set_loras` does on OpenVINO (a low-rank branch beside every linear "
                      "layer the build recorded, A and B switched as inputs, rank 0 for none; the base weights as "
                      "built); (a) replaces each adapted layer's weight constant in the IR and compiles again. (a) "
                      "does not apply to int8 weights without requantizing them (said in its row)."]}]


def _arguments(group) -> None:
    group.add_argument("--lora-steps", type=int, default=4, help="steps of the LoRA table's runs (at --size)")
    group.add_argument("--lora-openvino", default="openvino-bf16,openvino-int8", metavar="LABEL[,LABEL]",
                       help="the OpenVINO artifacts (the openvino table's labels) whose two LoRA designs it times")
    group.add_argument("--lora-quantized", default="int8", metavar="PRECISION[,PRECISION]",
                       help="the quantized ONNX Runtime artifacts (int8, fp8) it applies, switches and steps the adapter "
                            "on ('' for none)")


# Its adapter is made on the attention projections of SD3's transformer (`make_adapter`).
TABLE = Table("lora", "LoRA on a built artifact", "the default artifact with a random adapter applied", ("sd3",),
              measure, _arguments, smoke=("--lora-steps", "1", "--lora-openvino", "openvino-int8"))
