"""What First-Block Cache (runners/caches/first_block.py, diffusers' `FirstBlockCacheConfig`) needs from
a transformer's export, for every family whose transformer is a list of blocks (SD3, Flux, Z-Image).

- The denoiser graph gives one more output, `tail_residual`: the hidden stream after the last block
  minus after the first (what diffusers' FBC keeps on a full step). Its cost on an uncached step is
  one subtraction and one more output (measured: docs/skipping-steps.md).
- A second, small graph, `transformer_first_block`, runs the embeddings and the first block only. It
  returns the first block's residual (its hidden output minus its input: what the cache compares
  between steps) and the prediction of a cached step: the final norm and projection of the first
  block's output plus a given `tail_residual`.

A full step with the cache runs both graphs (the first block twice: 1/N of a step for N blocks), a
cached step only the small one. The main graph stays the one denoiser every build, precision,
calibration and adapter already handles; the small one holds only the embedders, block 0 and the
output layers (the same parameter names: adapters and weight provenance apply to it as to the main
one). The blocks and their output indices are diffusers' own (`TransformerBlockRegistry`), so the
graphs compute what diffusers' hooks do."""
from __future__ import annotations

import contextlib
import dataclasses
from contextlib import contextmanager

import torch

from export.spec import SubmoduleSpec, TensorSpec as T

NAME = "transformer_first_block"


def _block_lists(transformer) -> list[str]:
    """The names of the transformer's block lists as diffusers' `apply_first_block_cache` finds them: its
    ModuleList children named as diffusers' block lists, in the model's order (Flux: double, then single
    blocks; Z-Image: `layers`, its refiner blocks before them left out)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [name for name, child in transformer.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)]


def blocks(transformer) -> list:
    return [block for name in _block_lists(transformer) for block in transformer._modules[name]]


def _hidden_index(block, output) -> int | None:
    """Where a block's output holds the hidden stream: the element of its tuple diffusers'
    `TransformerBlockRegistry` names, or None where the output is it (Z-Image's blocks return one tensor)."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    return TransformerBlockRegistry.get(type(block)).return_hidden_states_index if isinstance(output, tuple) else None


def _hidden_output(block, output):
    i = _hidden_index(block, output)
    return output if i is None else output[i]


def _hidden_input(args, kwargs):
    # Flux and SD3 pass it by name; Z-Image's blocks take it first, as `x` (which diffusers' hooks, looking
    # for "hidden_states" in the signature, do not find: tests/test_z_image.py)
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@contextmanager
def hooked(block, hook):
    handle = block.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def adopt(module, wrapper) -> None:
    """Make the wrapper's children `module`'s own, so that weight names keep their one prefix
    ("transformer."), which the export maps to the checkpoint's keys and the precision passes' scopes."""
    module._modules.update(wrapper._modules)
    module.__dict__["wrapper"] = wrapper  # not a child: its parameters are already module's


class WithTailResidual(torch.nn.Module):
    """A family's transformer wrapper whose outputs gain `tail_residual`; with `traced` (the trace the graphs are cut
    from), then the first block's residual, and with `block_outputs` the stack of every block's hidden output too."""

    def __init__(self, wrapper, traced: bool = False, block_outputs: bool = False):
        super().__init__()
        adopt(self, wrapper)
        self.traced, self.block_outputs = traced, block_outputs

    def forward(self, *inputs):
        taken = []  # each block's (hidden input, hidden output), in the order they run

        def take(block, args, kwargs, output):
            taken.append((_hidden_input(args, kwargs), _hidden_output(block, output)))

        with contextlib.ExitStack() as stack:
            for block in blocks(self.wrapper.transformer):
                stack.enter_context(hooked(block, take))
            outputs = self.wrapper(*inputs)
        (head_in, head_out), (_, tail_out) = taken[0], taken[-1]
        traced = (head_out - head_in,) if self.traced else ()
        stacked = (torch.stack([out for _, out in taken]),) if self.block_outputs else ()
        return (*outputs, tail_out - head_out, *traced, *stacked)


def _first_block_only(transformer):
    """A shallow copy of `transformer` that holds its first block only (its parameters keep their
    names; the other blocks are not part of it, so the graph does not carry their weights)."""
    head = object.__new__(type(transformer))
    head.__dict__.update(transformer.__dict__)
    head._modules = dict(transformer._modules)
    lists = _block_lists(transformer)
    for name in lists:
        head._modules[name] = torch.nn.ModuleList()
    head._modules[lists[0]] = torch.nn.ModuleList([blocks(transformer)[0]])
    return head


class FirstBlock(torch.nn.Module):
    """The family's wrapper on the transformer cut after its first block: inputs the transformer's and
    `tail_residual`; outputs the prediction from the first block's output plus `tail_residual`, and the
    first block's residual."""

    def __init__(self, wrap, transformer):
        super().__init__()
        adopt(self, wrap(_first_block_only(transformer)))

    def forward(self, *inputs):
        *inputs, tail_residual = inputs
        head = blocks(self.wrapper.transformer)[0]
        taken = {}

        def add_tail(block, args, kwargs, output):
            i = _hidden_index(block, output)
            taken["residual"] = _hidden_output(block, output) - _hidden_input(args, kwargs)
            if i is None:
                return output + tail_residual
            return tuple(o + tail_residual if j == i else o for j, o in enumerate(output))

        with hooked(head, add_tail):
            outputs = self.wrapper(*inputs)
        return (*outputs, taken["residual"])


HIDDEN = ("batch", "image_tokens", "inner_dim")  # the transformer's hidden stream (SD3, Flux: the image's)
TAIL = "tail_residual"
BLOCK_OUTPUTS = "block_outputs"  # a trace's stack of every block's hidden output, where ControlNet residuals go
RESIDUAL = "block_residual_"  # + the block: a ControlNet residual input, added to that block's hidden output


def transformer_specs(spec: SubmoduleSpec, hidden: tuple[str, ...] = HIDDEN,
                      block_outputs: bool = False) -> tuple[SubmoduleSpec, SubmoduleSpec]:
    """The family's transformer description, and its first-block graph's (see the module's docstring);
    `hidden`: the dims of the hidden stream the blocks pass on. Both graphs are cut from one trace of the
    transformer that returns both residuals (`cut_to_outputs`, `cut_after_first_block`); the descriptions' own
    wrappers are what the export checks each graph against. With `block_outputs`, the trace also holds every
    block's hidden output, from which `with_block_residuals` cuts the graph that adds ControlNet residuals."""
    tail, residual = _residual_outputs(hidden)
    traced = _traced(spec, hidden, block_outputs)
    full = dataclasses.replace(spec, outputs=(*spec.outputs, tail), cut_from=(traced, cut_to_outputs),
                               wrap=lambda component: WithTailResidual(spec.wrap(component)))
    first = dataclasses.replace(spec, name=NAME, inputs=(*spec.inputs, tail), cut_from=(traced, cut_after_first_block),
                                outputs=(*spec.outputs, residual),
                                wrap=lambda component: FirstBlock(spec.wrap, component))
    return full, first


def _traced(spec: SubmoduleSpec, hidden: tuple[str, ...], block_outputs: bool) -> SubmoduleSpec:
    """The description of the trace `spec`'s graphs are cut from (one key: the same for every graph cut from it)."""
    outputs = (*spec.outputs, *_residual_outputs(hidden),
               *((T(BLOCK_OUTPUTS, "float32", ("blocks", *hidden)),) if block_outputs else ()))
    return dataclasses.replace(spec, outputs=outputs, wrap=lambda component: WithTailResidual(
        spec.wrap(component), traced=True, block_outputs=block_outputs))


def _residual_outputs(hidden: tuple[str, ...]) -> tuple[T, T]:
    """`tail_residual` and `first_block_residual`, of the blocks' hidden stream."""
    return T(TAIL, "float32", hidden), T("first_block_residual", "float32", hidden)


def block_residuals(indices, hidden: tuple[str, ...] = HIDDEN) -> tuple[T, ...]:
    """The ControlNet residual inputs of a transformer that adds one to the hidden output of each block of `indices`."""
    return tuple(T(f"{RESIDUAL}{i}", "float32", hidden) for i in indices)


def with_block_residuals(spec: SubmoduleSpec, residuals: tuple[T, ...], wrap,
                         hidden: tuple[str, ...] = HIDDEN) -> SubmoduleSpec:
    """`spec`'s full graph that also takes `residuals` (`block_residuals`), as `wrap` (the family's wrapper that adds
    them, which the export checks the graph against) computes it. It is cut from the trace of `spec`'s own graphs
    (`transformer_specs(..., block_outputs=True)`): one trace, with ControlNets or without, which the trace cache
    keeps across exports, so a model exported before is not traced again to add a ControlNet."""
    tail, _ = _residual_outputs(hidden)
    return dataclasses.replace(spec, inputs=(*spec.inputs, *residuals), outputs=(*spec.outputs, tail),
                               cut_from=(_traced(spec, hidden, True), cut_adding_residuals),
                               wrap=lambda component: WithTailResidual(wrap(component)))


def cut_to_outputs(model, spec: SubmoduleSpec) -> None:
    """The traced graph less the outputs `spec` does not name, and what only they needed."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    wanted = {t.name for t in spec.outputs}
    kept = [v for v in model.graph.outputs if v.name in wanted]
    model.graph.outputs.clear()
    model.graph.outputs.extend(kept)
    RemoveUnusedNodesPass()(model)


def cut_after_first_block(model, spec: SubmoduleSpec) -> None:
    """The first-block graph from the trace of the whole transformer: the output layers read the first block's
    hidden output plus a new input, `tail_residual`, where they read the last block's; the blocks after the first,
    read by nothing then, go. The trace's `tail_residual` output (last minus first block's hidden output, cast to
    float32 in an fp16 graph) names the two streams."""
    sub = _tail_subtraction(model.graph, spec)
    last, first = sub.inputs
    total = _plus_input(model.graph, first, spec.inputs[-1], after=last.producer())  # before what reads the last's
    _read_instead(last, total, keep=sub)
    cut_to_outputs(model, spec)


def cut_adding_residuals(model, spec: SubmoduleSpec) -> None:
    """The full graph with a residual input per `block_residual_<block>` of `spec`: added to that block's hidden
    output (the trace's `block_outputs` name them) where the next block, or the output layers, read it. The
    `tail_residual` stays the blocks' own outputs' difference, as the wrapper's hooks see them."""
    graph = model.graph
    sub, outputs = _tail_subtraction(graph, spec), _block_outputs(graph, spec)
    traced = {v.name for v in graph.inputs}
    for t in spec.inputs:
        if t.name not in traced:
            output = outputs[int(t.name.removeprefix(RESIDUAL))]
            _read_instead(output, _plus_input(graph, output, t, after=output.producer()), keep=sub)
    cut_to_outputs(model, spec)


def _tail_subtraction(graph, spec: SubmoduleSpec):
    """The node the trace's `tail_residual` comes from (through the cast of an fp16 graph): last minus first block's
    hidden output."""
    sub = next(v for v in graph.outputs if v.name == TAIL).producer()
    if sub.op_type == "Cast":
        sub = sub.inputs[0].producer()
    if sub.op_type != "Sub":
        raise ValueError(f"{spec.name}: the trace's {TAIL} comes from {sub.op_type}, not the subtraction of the "
                         "first block's hidden output from the last's")
    return sub


def _block_outputs(graph, spec: SubmoduleSpec) -> list:
    """Each block's hidden output, as the trace's `block_outputs` stacks them (Concat of Unsqueezes, cast in fp16)."""
    stack = next(v for v in graph.outputs if v.name == BLOCK_OUTPUTS).producer()
    if stack.op_type == "Cast":
        stack = stack.inputs[0].producer()
    parts = [v.producer() for v in stack.inputs] if stack.op_type == "Concat" else [None]
    if any(p is None or p.op_type != "Unsqueeze" for p in parts):
        raise ValueError(f"{spec.name}: the trace's {BLOCK_OUTPUTS} are not a stack of the blocks' hidden outputs")
    return [p.inputs[0] for p in parts]


def _plus_input(graph, value, given: T, after):
    """`value` plus a new float32 graph input `given` (cast to `value`'s type in an fp16 graph), computed right
    after the node `after`: the sum's value."""
    import onnx_ir as ir

    new = ir.Value(name=given.name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(given.shape))
    nodes = []
    if value.dtype != ir.DataType.FLOAT:  # an fp16 graph computes in fp16 what it takes in float32
        nodes.append(ir.node("Cast", [new], {"to": value.dtype}, name=f"{given.name}_cast"))
    nodes.append(ir.node("Add", [value, nodes[-1].outputs[0] if nodes else new], name=f"{given.name}_add"))
    for node in nodes:  # the traced values' type and shape, as the exporter gives every value
        node.outputs[0].type, node.outputs[0].shape = value.type, ir.Shape(list(value.shape))
    graph.insert_after(after, nodes)
    graph.inputs.append(new)
    return nodes[-1].outputs[0]


def _read_instead(value, total, keep) -> None:
    """Every node that reads `value` reads `total` instead, but `keep` and the node computing `total`."""
    for user, index in list(value.uses()):
        if user is not keep and user is not total.producer():
            user.replace_input_with(index, total)


def inner_dim(transformer_config: dict) -> int:
    return transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]
