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
    """A family's transformer wrapper whose outputs gain `tail_residual` (and, with `head_residual`, then the first
    block's residual: the trace both graphs are cut from)."""

    def __init__(self, wrapper, head_residual: bool = False):
        super().__init__()
        adopt(self, wrapper)
        self.head_residual = head_residual

    def forward(self, *inputs):
        head, tail = blocks(self.wrapper.transformer)[0], blocks(self.wrapper.transformer)[-1]
        taken = {}

        def take(name):  # (the block's hidden input, its hidden output)
            def hook(block, args, kwargs, output):
                taken[name] = _hidden_input(args, kwargs), _hidden_output(block, output)
            return hook

        with hooked(head, take("head")), hooked(tail, take("tail")):
            outputs = self.wrapper(*inputs)
        (head_in, head_out), (_, tail_out) = taken["head"], taken["tail"]
        return (*outputs, tail_out - head_out, *((head_out - head_in,) if self.head_residual else ()))


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


def transformer_specs(spec: SubmoduleSpec, hidden: tuple[str, ...] = HIDDEN) -> tuple[SubmoduleSpec, SubmoduleSpec]:
    """The family's transformer description, and its first-block graph's (see the module's docstring);
    `hidden`: the dims of the hidden stream the blocks pass on. Both graphs are cut from one trace of the
    transformer that returns both residuals (`cut_to_outputs`, `cut_after_first_block`); the descriptions' own
    wrappers are what the export checks each graph against."""
    tail, residual = T("tail_residual", "float32", hidden), T("first_block_residual", "float32", hidden)
    traced = dataclasses.replace(spec, outputs=(*spec.outputs, tail, residual),
                                 wrap=lambda component: WithTailResidual(spec.wrap(component), head_residual=True))
    full = dataclasses.replace(spec, outputs=(*spec.outputs, tail), cut_from=(traced, cut_to_outputs),
                               wrap=lambda component: WithTailResidual(spec.wrap(component)))
    first = dataclasses.replace(spec, name=NAME, inputs=(*spec.inputs, tail), cut_from=(traced, cut_after_first_block),
                                outputs=(*spec.outputs, residual),
                                wrap=lambda component: FirstBlock(spec.wrap, component))
    return full, first


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
    import onnx_ir as ir

    graph = model.graph
    sub = next(v for v in graph.outputs if v.name == "tail_residual").producer()
    if sub.op_type == "Cast":
        sub = sub.inputs[0].producer()
    if sub.op_type != "Sub":
        raise ValueError(f"{spec.name}: the trace's tail_residual comes from {sub.op_type}, not the subtraction of the "
                         "first block's hidden output from the last's")
    last, first = sub.inputs
    given = ir.Value(name="tail_residual", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(spec.inputs[-1].shape))
    nodes = []
    if first.dtype != ir.DataType.FLOAT:  # an fp16 graph computes in fp16 what it takes in float32
        nodes.append(ir.node("Cast", [given], {"to": first.dtype}, name="tail_residual_cast"))
    nodes.append(ir.node("Add", [first, nodes[-1].outputs[0] if nodes else given], name="first_block_plus_tail"))
    for node in nodes:  # the traced values' type and shape, as the exporter gives every value
        node.outputs[0].type, node.outputs[0].shape = first.type, ir.Shape(list(first.shape))
    graph.insert_after(last.producer(), nodes)  # before anything that reads the last block's output
    add = nodes[-1]
    for user, index in list(last.uses()):
        if user is not sub:
            user.replace_input_with(index, add.outputs[0])
    graph.inputs.append(given)
    cut_to_outputs(model, spec)


def inner_dim(transformer_config: dict) -> int:
    return transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]
