"""A deployed runner needs numpy, tokenizers, Pillow and its backend: never torch, diffusers or
transformers. A subprocess blocks those imports outright and runs a whole pipeline."""
from __future__ import annotations

import subprocess
import sys
import textwrap

FORBIDDEN = ("torch", "diffusers", "transformers")


def test_runner_runs_without_torch_diffusers_or_transformers(tiny_artifact):
    assert_runs_without_build_libraries(tiny_artifact)


def assert_runs_without_build_libraries(artifact) -> None:
    """Load `artifact` and make an image in a process where importing torch, diffusers or
    transformers fails (every backend's test calls this)."""
    script = textwrap.dedent(f"""
        import sys
        FORBIDDEN = {FORBIDDEN!r}

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in FORBIDDEN:
                    raise ImportError("the runner imported " + name)

        sys.meta_path.insert(0, Block())
        from runners import Pipeline
        pipe = Pipeline.load({str(artifact)!r})
        images = pipe("a photo of a cat", height=64, width=64, num_inference_steps=2, seed=0)
        assert images[0].size == (64, 64)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
        print("LOADED", loaded)
        sys.exit(1 if loaded else 0)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOADED []" in r.stdout
