"""The Pallas Mosaic GPU kernels lower for CUDA, checked on CPU (no GPU needed).

Needs the Mosaic GPU bindings, which ship in ``jax-cuda12-plugin``. They are kept out of the test
environment, where they would make JAX look for a GPU: .ci/run installs them with --no-deps into a
side folder and names it in ``JAXDECODE_MOSAIC_GPU_PATH``, and tests/gpu_lowering_worker.py runs
in a subprocess with that folder on its path. Without the variable the test skips, unless
``JAXDECODE_REQUIRE_GPU_LOWERING=1`` (CI), where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_kernels_lower_for_cuda():
    side = os.environ.get("JAXDECODE_MOSAIC_GPU_PATH")
    if not side:
        msg = "set JAXDECODE_MOSAIC_GPU_PATH to a folder holding jax-cuda12-plugin (see .ci/run)"
        if os.environ.get("JAXDECODE_REQUIRE_GPU_LOWERING") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), side, env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"  # lowering for CUDA needs no CUDA device
    proc = subprocess.run([sys.executable, str(HERE / "gpu_lowering_worker.py")],
                          capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("OK ", "FAIL "))]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stderr[-3000:]}"
    failed = [line for line in lines if line.startswith("FAIL")]
    assert not failed, "\n".join(failed)
    assert len(lines) == 6, lines
