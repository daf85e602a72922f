"""The schedulers the runner ports to numpy, by the `_class_name` of a scheduler_config.json.

Every scheduler answers `start(num_inference_steps, mu=None)` with a `Schedule`: the timesteps
to feed the denoiser, the initial noise scale, the input scaling and the update, so one
denoising loop (runners/pipeline.py) drives them all. The tests check each port against
diffusers. Options a port does not implement are refused at load time rather than ignored.
"""
from __future__ import annotations

from runners.schedulers.ddim import DDIM
from runners.schedulers.euler import EulerDiscrete
from runners.schedulers.flow_match import FlowMatchEulerDiscrete
from runners.schedulers.pndm import PNDM
from runners.schedulers.unipc import UniPCMultistep

SCHEDULERS = {
    "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscrete,
    "EulerDiscreteScheduler": EulerDiscrete,
    "DDIMScheduler": DDIM,
    "PNDMScheduler": PNDM,
    "UniPCMultistepScheduler": UniPCMultistep,
}


def load_scheduler(config: dict):
    name = config.get("_class_name")
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler {name!r} is not supported by the runner; supported: {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name](config)
