"""An engine that Triton serves as a model of its own backend (a repository's native layout,
runners/serving/repository.py): each run is a BLS request from the pipeline's Python-backend
model. Only Triton's Python backend stub has `triton_python_backend_utils`."""
from __future__ import annotations

import numpy as np

from runners.backends import Backend


class BlsSession:
    def __init__(self, model: str, outputs: list[str]):
        import triton_python_backend_utils as pb_utils

        self.pb_utils, self.model, self.outputs = pb_utils, model, list(outputs)

    def run(self, feeds: dict, release: bool = False) -> dict:
        pb = self.pb_utils
        inputs = [pb.Tensor(name, np.ascontiguousarray(value)) for name, value in feeds.items()]
        response = pb.InferenceRequest(model_name=self.model, requested_output_names=self.outputs,
                                       inputs=inputs).exec()
        if response.has_error():
            raise RuntimeError(f"Triton model {self.model}: {response.error().message()}")
        return {name: pb.get_output_tensor_by_name(response, name).as_numpy() for name in self.outputs}

    def close(self) -> None:
        """Triton owns the engine's model: nothing to free here."""


# A native Triton repository's engine model, called from its pipeline model (runners/serving/repository.py).
BACKENDS = [Backend("triton", "Triton BLS", lambda path, device=None, **options: BlsSession(**options["session_options"]))]
