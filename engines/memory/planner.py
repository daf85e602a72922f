"""The liveness plan of a node order, as ONNX Runtime's CPU provider executes it.

A tensor's buffer is allocated when its producer runs and freed after its last reader. Two runtime
behaviours are modelled because they decide the peak:
- views: Reshape, Squeeze, Unsqueeze, Flatten and Identity write no new buffer, their output shares
  their input's (ONNX Runtime's kernels declare it an alias);
- in place (`inplace=True`): an activation writes its output into its input's buffer when no later
  node reads the input. Measured on ONNX Runtime 1.31's CPU provider (tests/test_memory.py): Relu,
  Sigmoid, Tanh, Elu, LeakyRelu, Selu, Softplus, Softsign and HardSigmoid run in place; Add, Sub, Mul, Div, Sqrt, Exp, Erf and QuickGelu never do.
Graph inputs are live from the start, graph outputs to the end; weights are not activations. A
kernel's own scratch (`OpGraph.workspace`: fused attention's probabilities) is live while it runs.

`memory_order` is the greedy schedule the `schedule_memory` pass writes: of the nodes whose inputs
are ready, run the one that adds the fewest live bytes (ties keep the file's order).
"""
from __future__ import annotations

import dataclasses
import heapq

from engines.memory.graph import OpGraph

VIEW_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
INPLACE_OPS = {"Relu", "Sigmoid", "Tanh", "Elu", "LeakyRelu", "Selu", "Softplus", "Softsign", "HardSigmoid"}


@dataclasses.dataclass
class Buffer:
    nbytes: int
    start: int  # the step that writes it
    end: int  # the last step that reads it (len(order) for graph outputs)
    tensor: str  # the tensor that first wrote it
    writer: int | None = None  # the node that first wrote it (None: a graph input)
    reads: int = 0
    writes: int = 1
    graph_input: bool = False


@dataclasses.dataclass
class Plan:
    order: list[int]  # node indices in execution order
    buffers: list[Buffer]
    live: list[int]  # bytes live at each step
    producer: dict[str, int]  # tensor -> node index

    @property
    def peak(self) -> int:
        return max(self.live, default=0)

    @property
    def peak_step(self) -> int:
        return self.live.index(self.peak) if self.live else 0

    def live_at(self, step: int) -> list[Buffer]:
        return sorted((b for b in self.buffers if b.start <= step <= b.end), key=lambda b: -b.nbytes)

    def offchip_bytes(self, sram: int) -> int:
        """Activation bytes moved to and from off-chip memory when only `sram` bytes fit on chip:
        a buffer goes on chip when it is written, if it fits beside the buffers already there;
        every write and read of a buffer that does not is traffic."""
        on_chip_until: list[tuple[int, int]] = []  # heap of (end step, bytes)
        used = moved = 0
        for b in sorted(self.buffers, key=lambda b: b.start):
            while on_chip_until and on_chip_until[0][0] < b.start:
                used -= heapq.heappop(on_chip_until)[1]
            if not b.graph_input and used + b.nbytes <= sram:
                used += b.nbytes
                heapq.heappush(on_chip_until, (b.end, b.nbytes))
            else:
                moved += b.nbytes * (b.reads + (0 if b.graph_input else b.writes))
        return moved


def _last_reads(graph: OpGraph, order: list[int]) -> dict[str, int]:
    end = {}
    for step, i in enumerate(order):
        for t in graph.nodes[i].inputs:
            if t in graph.nbytes:
                end[t] = step
    for t in graph.outputs:
        end[t] = len(order)
    return end


def plan(graph: OpGraph, order: list[int] | None = None, inplace: bool = True) -> Plan:
    order = list(range(len(graph.nodes))) if order is None else order
    end = _last_reads(graph, order)
    buf_of: dict[str, Buffer] = {}
    buffers = []
    for t in graph.inputs:
        buf_of[t] = Buffer(graph.nbytes[t], 0, end.get(t, 0), t, writes=0, graph_input=True)
        buffers.append(buf_of[t])
    producer = {}
    for step, i in enumerate(order):
        node = graph.nodes[i]
        ins = [t for t in node.inputs if t in buf_of]
        if node.op_type not in VIEW_OPS | {"Shape", "Size"}:  # these read no element
            for t in ins:
                buf_of[t].reads += 1
        for k, out in enumerate(node.outputs):
            if not out:
                continue
            producer[out] = i
            last = end.get(out, step)
            first = buf_of.get(node.inputs[0]) if node.inputs else None
            if k == 0 and node.op_type in VIEW_OPS and first is not None:
                first.end = max(first.end, last)
                buf_of[out] = first
                continue
            if k == 0 and inplace and node.op_type in INPLACE_OPS:
                dying = next((buf_of[t] for t in ins if buf_of[t].end == step and not buf_of[t].graph_input
                              and buf_of[t].nbytes == graph.nbytes[out]), None)
                if dying is not None:
                    dying.end, dying.writes = last, dying.writes + 1
                    buf_of[out] = dying
                    continue
            buf_of[out] = Buffer(graph.nbytes[out], step, last, out, i)
            buffers.append(buf_of[out])
        if graph.workspace[i]:
            buffers.append(Buffer(graph.workspace[i], step, step, f"{node.name} (workspace)", i, reads=1))
    delta = [0] * (len(order) + 2)
    for b in buffers:
        delta[b.start] += b.nbytes
        delta[b.end + 1] -= b.nbytes
    live, total = [], 0
    for step in range(len(order)):
        total += delta[step]
        live.append(total)
    return Plan(order, buffers, live, producer)


def memory_order(graph: OpGraph) -> list[int]:
    """A topological order that greedily keeps the live bytes low (see the module's docstring)."""
    nodes = graph.nodes
    producer = {out: i for i, n in enumerate(nodes) for out in n.outputs if out}
    readers: dict[str, int] = {}
    for n in nodes:
        for t in set(n.inputs):
            if t in graph.nbytes:
                readers[t] = readers.get(t, 0) + 1
    waiting = [len({producer[t] for t in n.inputs if t in producer}) for n in nodes]
    users: dict[int, set[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t in producer:
                users.setdefault(producer[t], set()).add(i)
    # Buffers as the planner sees them: tensor -> buffer id; a buffer is freed when its readers are done.
    buf_of = {t: t for t in graph.inputs}
    pending = {t: readers.get(t, 0) + (1 if t in graph.outputs else 0) for t in graph.inputs}
    size = {t: graph.nbytes[t] for t in graph.inputs}

    def effect(i: int):
        """What running node i does now: (bytes it adds minus bytes it frees, {output: the buffer it
        shares, or None for a new one}, {buffer: reads})."""
        node = nodes[i]
        reads: dict[str, int] = {}
        for t in set(node.inputs):
            if t in buf_of:
                reads[buf_of[t]] = reads.get(buf_of[t], 0) + 1
        dying = [b for b, r in reads.items() if pending[b] == r and b not in graph.inputs]
        placed, added = {}, 0
        for k, out in enumerate(node.outputs):
            if not out:
                continue
            first = buf_of.get(node.inputs[0]) if node.inputs else None
            same_size = [b for b in dying if size[b] == graph.nbytes[out] and b not in placed.values()]
            if k == 0 and node.op_type in VIEW_OPS and first is not None:
                placed[out] = first
            elif k == 0 and node.op_type in INPLACE_OPS and same_size:
                placed[out] = same_size[0]
            else:
                placed[out], added = None, added + graph.nbytes[out]
        freed = sum(size[b] for b in dying if b not in placed.values())
        return added - freed, placed, reads

    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        best = min(ready, key=lambda i: (effect(i)[0], i))
        ready.remove(best)
        order.append(best)
        _, placed, reads = effect(best)
        for b, r in reads.items():
            pending[b] -= r
        for out, shared in placed.items():
            later = readers.get(out, 0) + (1 if out in graph.outputs else 0)
            if shared is None:
                buf_of[out], pending[out], size[out] = out, later, graph.nbytes[out]
            else:
                buf_of[out] = shared
                pending[shared] += later
        for j in users.get(best, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle or reads a tensor nothing produces")
    return order
