"""What First-Block Cache (runners/caches/first_block.py, diffusers' `FirstBlockCacheConfig`) needs from
a transformer's export, for every family whose transformer is a list of blocks (SD3, Flux).

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
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")  # in diffusers' order (Flux: double, single)


def blocks(transformer) -> list:
    return [block for name in BLOCK_LISTS for block in getattr(transformer, name, ())]


def _hidden_index(block) -> int:
    from diffusers.hooks._helpers import TransformerBlockRegistry

    return TransformerBlockRegistry.get(type(block)).return_hidden_states_index


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
    """A family's transformer wrapper whose outputs gain `tail_residual`."""

    def __init__(self, wrapper):
        super().__init__()
        adopt(self, wrapper)

    def forward(self, *inputs):
        head, tail = blocks(self.wrapper.transformer)[0], blocks(self.wrapper.transformer)[-1]
        taken = {}

        def take(name):
            def hook(block, args, kwargs, output):
                taken[name] = output[_hidden_index(block)]
            return hook

        with hooked(head, take("head")), hooked(tail, take("tail")):
            outputs = self.wrapper(*inputs)
        return (*outputs, taken["tail"] - taken["head"])


def _first_block_only(transformer):
    """A shallow copy of `transformer` that holds its first block only (its parameters keep their
    names; the other blocks are not part of it, so the graph does not carry their weights)."""
    head = object.__new__(type(transformer))
    head.__dict__.update(transformer.__dict__)
    head._modules = dict(transformer._modules)
    for name in BLOCK_LISTS:
        if name in head._modules:
            head._modules[name] = torch.nn.ModuleList()
    head._modules["transformer_blocks"] = torch.nn.ModuleList([blocks(transformer)[0]])
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
        head = self.wrapper.transformer.transformer_blocks[0]
        taken = {}

        def add_tail(block, args, kwargs, output):
            i = _hidden_index(block)
            taken["residual"] = output[i] - kwargs["hidden_states"]
            return tuple(o + tail_residual if j == i else o for j, o in enumerate(output))

        with hooked(head, add_tail):
            outputs = self.wrapper(*inputs)
        return (*outputs, taken["residual"])


HIDDEN = ("batch", "image_tokens", "inner_dim")  # the transformer's hidden stream


def transformer_specs(spec: SubmoduleSpec) -> tuple[SubmoduleSpec, SubmoduleSpec]:
    """The family's transformer description, and its first-block graph's (see the module's docstring)."""
    tail = T("tail_residual", "float32", HIDDEN)
    full = dataclasses.replace(spec, outputs=(*spec.outputs, tail),
                               wrap=lambda component: WithTailResidual(spec.wrap(component)))
    first = dataclasses.replace(spec, name=NAME, inputs=(*spec.inputs, tail),
                                outputs=(*spec.outputs, T("first_block_residual", "float32", HIDDEN)),
                                wrap=lambda component: FirstBlock(spec.wrap, component))
    return full, first


def inner_dim(transformer_config: dict) -> int:
    return transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]
