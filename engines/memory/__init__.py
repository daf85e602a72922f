"""Activation memory: what a graph holds while it runs, and the tools to lower it.

- `graph`: an exported graph at concrete dims (every tensor's bytes, every node's FLOPs);
- `planner`: the liveness plan of a node order as ONNX Runtime executes it (peak, what is live at
  the peak, bytes moved off-chip past an on-chip budget);
- `inspect`: `python -m engines inspect`, the table per submodule.

The passes that lower the peak (`fuse_elementwise`, `schedule_memory`, `remat`) live with the
other passes in `engines/passes/` and plan with this package.
"""
