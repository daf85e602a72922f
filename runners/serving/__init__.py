"""Serving an artifact with NVIDIA Triton Inference Server: `repository` writes a model repository
(python or native layout), `triton_model` is the Python-backend model inside it, `requests` maps
Triton tensors to Pipeline calls, `server` runs tritonserver on a repository, `kserve` writes the
InferenceService that scales it out, and `cli` is `python -m runners triton|serve`."""
