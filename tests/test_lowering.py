"""export/lowering.py: a graph lowered by rewriting its nodes is the graph of the exporter's own decomposition (the
same ONNX operators, at most a few size computations fewer; the type promotion's casts; the same outputs at shapes
other than the traced one), and a graph with an operator it has no rewrite for is still decomposed by the
exporter."""
from __future__ import annotations

import collections
import contextlib
from unittest import mock

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from export import lowering


class EveryRewrite(torch.nn.Module):
    """An op of each rewrite, on a batch and a length that are dynamic."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.norm = torch.nn.RMSNorm(8, eps=1e-6)

    def forward(self, x, mask):
        b, n, _ = x.shape
        h = self.proj(x).unflatten(-1, (4, -1)).transpose(1, 2)  # (b, 4, n, 4)
        h = h.contiguous().view(b, 4 * n, 4).view(b, 4, n, 4).transpose(1, 2).reshape(b, n, 16)  # views of a copy
        q, k = self.drop(h).chunk(2, dim=-1)
        with torch.autocast("cuda", enabled=False):  # as diffusers' RoPE: casts nothing on a CPU
            rope = (q.float() * k.to(torch.float64)).to(x.dtype)
        keep = (mask > 0) & (mask < 3) | (mask == 5)
        normed = self.norm(rope) + F.rms_norm(rope.half(), (8,)).float()  # in fp32 for the fp16 input
        angles = torch.outer(torch.arange(n, dtype=x.dtype), self.proj.bias)
        copy = h * 1
        copy.detach_()
        buckets = (mask > 2).to(torch.long) * 4
        buckets += mask  # T5's relative position buckets: in place, on a tensor of its own
        moved = torch.square(copy.movedim(-1, 0)).min(1 - h.movedim(-1, 0)).clip(-2, 2)
        return (torch.where(keep[..., None], normed, 0.0).flatten(1), moved.flatten(0, 1), angles.cos(),
                buckets * 2, x.half() * x)  # the type promotion's: fp16 times fp32 is computed in fp32


class Unimplemented(torch.nn.Module):
    def forward(self, x):
        return x.diff(dim=0) + 1  # aten.diff: neither ONNX nor a rewrite here implements it


class WrittenThroughAView(torch.nn.Module):
    def forward(self, x):
        fresh = x * 1
        rows = fresh[:, :2]
        fresh.add_(1)  # in place on a tensor a view shares: not out of place
        return rows.repeat(1, 2) + fresh


def _export(module, args, dynamic_shapes, path, rewritten: bool):
    context = lowering.lowered_in_place() if rewritten else contextlib.nullcontext()
    with torch.no_grad(), context:
        torch.onnx.export(module, args, str(path), dynamo=True, dynamic_shapes=dynamic_shapes, optimize=True,
                          verbose=False)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _op_counts(path) -> collections.Counter:
    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_a_rewritten_graph_is_the_decomposed_one(tmp_path):
    torch.manual_seed(0)
    module = EveryRewrite().eval()
    args = (torch.randn(2, 6, 16), torch.randint(0, 6, (2, 6)))
    dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    calls = []
    real = lowering.rewrite
    with mock.patch.object(lowering, "rewrite", lambda *a: calls.append(real(*a)) or calls[-1]):
        ours = _export(module, args, (dims, dims), tmp_path / "ours.onnx", rewritten=True)
    assert calls == [True]
    theirs = _export(module, args, (dims, dims), tmp_path / "theirs.onnx", rewritten=False)
    ours_ops, theirs_ops = _op_counts(tmp_path / "ours.onnx"), _op_counts(tmp_path / "theirs.onnx")
    assert ours_ops - theirs_ops == collections.Counter()  # nothing more: fewer size computations, at most
    assert set(ours_ops) == set(theirs_ops)
    x, mask = torch.randn(3, 5, 16), torch.randint(0, 6, (3, 5))
    feeds = {"x": x.numpy(), "mask": mask.numpy()}
    with torch.no_grad():
        expected = [y.numpy() for y in module(x, mask)]
    for got in (ours.run(None, feeds), theirs.run(None, feeds)):
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", [Unimplemented(), WrittenThroughAView()], ids=type)
def test_an_op_without_a_rewrite_leaves_the_graph_to_the_exporter(tmp_path, module):
    x = torch.randn(4, 4)
    calls = []
    real = lowering.rewrite
    with mock.patch.object(lowering, "rewrite", lambda *a: calls.append(real(*a)) or calls[-1]):
        session = _export(module, (x,), ({0: torch.export.Dim.AUTO},), tmp_path / "m.onnx", rewritten=True)
    assert calls == [False]
    y = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(y)).numpy()
    np.testing.assert_allclose(session.run(None, {"x": y})[0], expected, rtol=1e-6)
