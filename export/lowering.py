"""Lower torch.export's graph to the operators torch.onnx translates by rewriting the few nodes that need it,
instead of tracing the whole graph a second time.

torch.onnx.export captures a graph (torch.export's training IR) and then runs `run_decompositions` on it, which
traces every operator again through the dispatcher: about as long as the capture itself, for graphs whose
operators ONNX implements nearly all already. `lowered_in_place` takes that step's place during an export: it
rewrites the nodes that step would decompose as it would (a reshape as a contiguous copy's view, a dtype
conversion as `_to_copy`, an autocast region that casts nothing inlined, ...), and leaves a graph with any other
operator ONNX lacks to the exporter's own decomposition. The exporter's type promotion pass, which runs every node
again on fake tensors, runs only the nodes it may promote. test_lowering.py compares the graphs of both ways.
(And the exporter's registry of ONNX functions, which it makes anew for every export, is made once a process.)
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
from unittest import mock

import torch
from torch.onnx._internal.exporter import _decomp, _fx_passes, _registration
from torch.onnx._internal.fx.passes import type_promotion

aten = torch.ops.aten
# Removed by the exporter after the decomposition step (its `remove_assertion_nodes`).
ASSERTIONS = {aten._assert_scalar.default, aten._assert_tensor_metadata.default, aten._assert_async.default,
              aten._assert_async.msg, aten.sym_constrain_range_for_size.default}


class _Rewriter:
    """One graph's rewrites, in its order: `size` finds the node that gives a symbolic size, among those before."""

    def __init__(self, module: torch.fx.GraphModule):
        self.module, self.graph = module, module.graph
        self.sizes = {}  # a SymInt's expression -> the first node giving it
        self.replaced = {}  # name of a node removed -> the name of the node that took its place
        self.erased = set()

    def call(self, like: torch.fx.Node, target, *args, **kwargs) -> torch.fx.Node:
        """A new node `target(*args, **kwargs)` where `like` is, its value computed on the graph's fake tensors."""
        new = self.graph.call_function(target, args, kwargs)
        values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        fake_mode = torch._guards.detect_fake_mode([like.meta["val"], *values[0]])
        with fake_mode, torch._dispatch.python.enable_python_dispatcher():
            new.meta = {**like.meta, "val": target(*values[0], **values[1])}
        return new

    def size(self, size, tensor: torch.fx.Node | None = None):
        """`size` (an int or a SymInt) as a view takes it: an int, the node before that gives it, or (with `tensor`)
        a new node that reads it from `tensor`'s shape; None where none does."""
        if not isinstance(size, torch.SymInt) or size.node.maybe_as_int() is not None:
            return int(size)
        if size.node.expr not in self.sizes and tensor is not None:
            axes = [a for a, d in enumerate(tensor.meta["val"].shape)
                    if isinstance(d, torch.SymInt) and d.node.expr == size.node.expr]
            if axes:
                self.sizes[size.node.expr] = self.call(tensor, aten.sym_size.int, tensor, axes[0])
        return self.sizes.get(size.node.expr)

    def sizes_of(self, tensor: torch.fx.Node, axes: slice) -> list:
        """`tensor`'s sizes on `axes`, as `size` gives them."""
        return [self.size(d, tensor) for d in tensor.meta["val"].shape[axes]]

    def reshape(self, node, tensor, shape) -> None:
        """`node` made the reshape of `tensor` to `shape` as torch decomposes one that may copy: a contiguous
        clone's `_unsafe_view` (in ONNX an Identity, which the optimizer drops, and a Reshape).

        The sizes are those of `node`'s result where the graph has them before (a -1 for at most one that it does
        not, as a -1 of `shape` inferred again from symbolic sizes can become an expression torch cannot simplify),
        then those `tensor`'s shape gives, else `shape()`'s. A size read from `tensor` is a Shape of it in ONNX: a
        second use, which a fusion's pattern (attention's Transpose -> Reshape) does not match."""
        result = node.meta["val"].shape
        sizes = [self.size(d) for d in result]
        if sizes.count(None) > 1:
            sizes = [self.size(d, tensor) if s is None else s for s, d in zip(sizes, result)]
        shape = [-1 if d is None else d for d in sizes] if sizes.count(None) <= 1 else shape()
        copy = self.call(tensor, aten.clone.default, tensor, memory_format=torch.contiguous_format)
        node.target, node.args, node.kwargs = aten._unsafe_view.default, (copy, list(shape)), {}

    def replace(self, node, value) -> None:
        self.replaced[node.name] = value.name
        node.replace_all_uses_with(value)
        self.graph.erase_node(node)
        self.erased.add(node)


def _to_copy(rw: _Rewriter, node) -> None:
    dtype = {aten.to.dtype: lambda: node.args[1], aten.to.device: lambda: node.args[2],
             aten.to.dtype_layout: lambda: node.kwargs.get("dtype")}[node.target]()
    node.target, node.args, node.kwargs = aten._to_copy.default, (node.args[0],), ({"dtype": dtype} if dtype else {})


def _clone(rw: _Rewriter, node) -> None:
    """An op that is the identity in inference (an evaluation's dropout, a detach): a copy."""
    node.target, node.args, node.kwargs = aten.clone.default, (node.args[0],), {}


def _contiguous(rw: _Rewriter, node) -> None:
    """A contiguous copy, which a view after it may need (the fake tensors are run again after this pass)."""
    node.target, node.args = aten.clone.default, (node.args[0],)
    node.kwargs = {"memory_format": torch.contiguous_format}


def _flatten(rw: _Rewriter, node) -> None:
    tensor, start, end = (*node.args, 0, -1)[:3]
    rank = tensor.meta["val"].dim()
    start, end = start % max(rank, 1), end % max(rank, 1)
    rw.reshape(node, tensor, lambda: [*rw.sizes_of(tensor, slice(start)), -1,
                                      *rw.sizes_of(tensor, slice(end + 1, None))])


def _unflatten(rw: _Rewriter, node) -> None:
    tensor, axis, sizes = node.args
    axis %= tensor.meta["val"].dim()
    rw.reshape(node, tensor, lambda: [*rw.sizes_of(tensor, slice(axis)), *sizes,
                                      *rw.sizes_of(tensor, slice(axis + 1, None))])


def _reshape(rw: _Rewriter, node) -> None:
    tensor, shape = node.args
    rw.reshape(node, tensor, lambda: shape)


def _chunk(rw: _Rewriter, node) -> None:
    tensor, chunks, axis = (*node.args, 0)[:3]
    size = int(tensor.meta["val"].shape[axis])
    node.target, node.args, node.kwargs = aten.split.Tensor, (tensor, math.ceil(size / chunks), axis), {}


def _rms_norm(rw: _Rewriter, node) -> None:
    """As torch decomposes it (`_fused_rms_norm`): in fp32 for a narrower input, its epsilon by default fp32's."""
    x, shape, weight, eps = (*node.args, None, None)[:4]
    weight, eps = node.kwargs.get("weight", weight), node.kwargs.get("eps", eps)
    dtype = x.meta["val"].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    eps = torch.finfo(torch.float32 if wide == torch.float32 else torch.float64).eps if eps is None else eps
    call = lambda target, *args, **kwargs: rw.call(node, target, *args, **kwargs)  # noqa: E731
    up = call(aten._to_copy.default, x, dtype=wide) if wide != dtype else x
    mean = call(aten.mean.dim, call(aten.pow.Tensor_Scalar, up, 2), [-1 - i for i in range(len(shape))], True)
    result = call(aten.mul.Tensor, up, call(aten.rsqrt.default, call(aten.add.Scalar, mean, eps)))
    if weight is not None:
        result = call(aten.mul.Tensor, result, weight)
    rw.replace(node, call(aten._to_copy.default, result, dtype=dtype) if wide != dtype else result)


def _outer(rw: _Rewriter, node) -> None:
    a, b = node.args
    column = rw.call(node, aten.view.default, a, [-1, 1])
    node.target, node.args = aten.mul.Tensor, (column, b)


def _movedim(rw: _Rewriter, node) -> None:
    tensor, source, destination = node.args
    rank = tensor.meta["val"].dim()
    order = [axis for axis in range(rank) if axis != source % rank]
    order.insert(destination % rank, source % rank)
    node.target, node.args = aten.permute.default, (tensor, order)


def _square(rw: _Rewriter, node) -> None:
    node.target, node.args = aten.pow.Tensor_Scalar, (node.args[0], 2)


def _rsub(rw: _Rewriter, node) -> None:
    """other - alpha * x, for a number `other`."""
    tensor, other, alpha = (*node.args, node.kwargs.get("alpha", 1))[:3]
    scaled = rw.call(node, aten.mul.Tensor, tensor, alpha) if alpha != 1 else tensor
    number = rw.call(node, aten.scalar_tensor.default, other, dtype=node.meta["val"].dtype)
    node.target, node.args, node.kwargs = aten.sub.Tensor, (number, scaled), {}


def _inline_autocast(rw: _Rewriter, node) -> None:
    """A `torch.autocast` region that casts nothing on the CPU the graph is traced on, as its own nodes."""
    getter = node.args[4]
    body = getattr(rw.module, getter.target)
    params = [p for p in body.graph.nodes if p.op == "placeholder"]
    results = rw.graph.graph_copy(body.graph, dict(zip(params, node.args[5:])))
    for user in list(node.users):
        rw.replace(user, results[user.args[1]])
    rw.graph.erase_node(node)
    if not getter.users:
        rw.graph.erase_node(getter)


def _out_of_place(target):
    """The op an in-place aten op computes without writing to its input (add_ -> add), or None."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[1]
    if not name.endswith("_") or name.endswith("__") or not target._schema.is_mutable:
        return None
    return getattr(getattr(aten, name[:-1], None), target._overloadname, None)


def _aliases(node) -> bool:
    """Whether `node`'s result may share its memory with another tensor: an input's, a view's, an in-place op's."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return node.op != "call_function" or node.target is operator.getitem
    schema = node.target._schema
    return schema.is_mutable or any(r.alias_info is not None for r in schema.returns)


def _writes_a_fresh_tensor(node) -> bool:
    """Whether an in-place op writes to a tensor no other one shares memory with (T5's `relative_buckets +=`): its
    result is then that of the op out of place, read by every later user of the tensor."""
    written = node.args[0]
    return (isinstance(written, torch.fx.Node) and not _aliases(written)
            and not any(_aliases(user) for user in written.users if user is not node))


def _out_of_place_rewrite(rw: _Rewriter, node) -> None:
    written = node.args[0]
    order = {n: i for i, n in enumerate(rw.graph.nodes)}
    for user in list(written.users):
        if order[user] > order[node]:
            user.replace_input_with(written, node)
            if user.op == "output":
                rw.replaced[written.name] = node.name
    node.target = _out_of_place(node.target)


def _renamed(target):
    def rename(rw: _Rewriter, node) -> None:
        node.target = target
    return rename


def _static_axis(node) -> bool:
    """Whether a chunk's axis has a size known at export."""
    tensor, axis = node.args[0], (*node.args, 0)[2]
    return not isinstance(tensor.meta["val"].shape[axis], torch.SymInt)


def _casts_nothing(node) -> bool:
    device, _, enabled = node.args[:3]
    return not (enabled and device == "cpu") and all(user.target is operator.getitem for user in node.users)


# op -> (its rewrite, whether it applies to a node: always where not given); and any in-place op, out of place
# where it writes to a tensor of its own (`_writes_a_fresh_tensor`)
REWRITES = {
    aten.to.dtype: (_to_copy,), aten.to.device: (_to_copy,), aten.to.dtype_layout: (_to_copy,),
    aten.contiguous.default: (_contiguous,), aten.dropout.default: (_clone, lambda node: not node.args[2]),
    aten.detach_.default: (_clone,), aten.rms_norm.default: (_rms_norm,), aten.outer.default: (_outer,),
    aten.movedim.int: (_movedim,), aten.square.default: (_square,), aten.rsub.Scalar: (_rsub,),
    aten.min.other: (_renamed(aten.minimum.default),), aten.clip.default: (_renamed(aten.clamp.default),),
    aten.flatten.using_ints: (_flatten,), aten.unflatten.int: (_unflatten,), aten.reshape.default: (_reshape,),
    aten.chunk.default: (_chunk, _static_axis),
    aten.__and__.Tensor: (_renamed(aten.bitwise_and.Tensor),), aten.__or__.Tensor: (_renamed(aten.bitwise_or.Tensor),),
    torch.ops.higher_order.wrap_with_autocast: (_inline_autocast, _casts_nothing),
}


def _rewrite_of(node) -> tuple | None:
    if node.target in REWRITES:
        return REWRITES[node.target]
    return (_out_of_place_rewrite, _writes_a_fresh_tensor) if _out_of_place(node.target) is not None else None


def _rewritten(node, implemented: set) -> bool | None:
    """Whether `node` is rewritten (None: it is kept; False: it cannot be, and the graph is decomposed). An op with
    a rewrite here is rewritten even where ONNX implements it, as the decomposition would."""
    if node.op != "call_function" or node.target in ASSERTIONS:
        return None
    rewrite = _rewrite_of(node)
    if rewrite is not None and (len(rewrite) == 1 or rewrite[1](node)):
        return True
    if node.target in implemented or not isinstance(node.target, (torch._ops.OpOverload,
                                                                   torch._ops.HigherOrderOperator)):
        return None  # also Python's operators on sizes, which the exporter translates as they are
    return False


def rewrite(program: torch.export.ExportedProgram, implemented: set) -> bool:
    """Rewrite `program`'s graphs in place so that ONNX implements each of their operators (`implemented`);
    False, the program unchanged, where an operator has no rewrite here."""
    modules = list(program.graph_module.modules())[::-1]  # a region's body before the graph that inlines it
    if any(_rewritten(node, implemented) is False for module in modules for node in module.graph.nodes):
        return False
    for module in modules:
        rw = _Rewriter(module)
        for node in list(module.graph.nodes):
            if node in rw.erased:
                continue
            value = node.meta.get("val")
            if node.op == "call_function" and isinstance(value, torch.SymInt):
                first = rw.sizes.setdefault(value.node.expr, node)
                if first is not node:  # one size read once, as the decomposition's trace reads it
                    rw.replace(node, first)
                    continue
            if _rewritten(node, implemented):
                with module.graph.inserting_before(node):
                    _rewrite_of(node)[0](rw, node)
        for spec in program.graph_signature.output_specs:
            while getattr(spec.arg, "name", None) in rw.replaced:
                spec.arg.name = rw.replaced[spec.arg.name]
        module.recompile()
    return True


def _promoting_only(run_node):
    """The exporter's type promotion pass runs every node again on fake tensors to learn its inputs' dtypes, which
    the values the capture recorded (`meta["val"]`) already give: only a node it may promote is run (with the casts
    it inserts, or whose output it casts back, a later node's inputs keep their dtypes)."""
    def run(interpreter, node):
        if (node.op == "call_function" and "val" in node.meta
                and type_promotion.get_type_promotion_rule(node, interpreter.type_promotion_table) is None):
            return node.meta["val"]
        return run_node(interpreter, node)
    return run


# 0.3 s an export; nothing changes it where no custom translation table is given (the export gives none)
_torchlib_registry = functools.cache(_registration.ONNXRegistry.from_torchlib)


@contextlib.contextmanager
def lowered_in_place():
    """torch.onnx.export within lowers its graphs by `rewrite`, or, where that cannot, by its own decomposition; and
    runs again only the nodes its type promotion may change; with the registry of ONNX functions made once."""
    decompose = _fx_passes.decompose_with_registry

    def lower(program, registry):
        if rewrite(program, set(_decomp.get_onnx_implemented_overloads(registry))):
            return program
        return decompose(program, registry)

    interpreter = type_promotion._TypePromotionInterpreter
    with (mock.patch.object(_fx_passes, "decompose_with_registry", lower),
          mock.patch.object(interpreter, "run_node", _promoting_only(interpreter.run_node)),
          mock.patch.object(_registration.ONNXRegistry, "from_torchlib", staticmethod(_torchlib_registry))):
        yield
