"""The README's Python blocks run as written, in order, in one namespace.

"path/to/Qwen3.5-0.8B" is a small random checkpoint (the ``tiny`` preset, real vocabulary) written
into a temporary directory the blocks run in, on 8 CPU devices (the Sharding block's mesh).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_devices_env

README = Path(__file__).resolve().parents[1] / "README.md"

RUNNER = r"""
import json, os, sys
import jax, numpy as np
import jaxdecode as jd
from jaxdecode.params import params_to_hf
from safetensors.numpy import save_file

path = os.path.join("path", "to", "Qwen3.5-0.8B")
os.makedirs(path)
config = jd.Config.from_preset("tiny")
with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config.to_hf_config(), f)
params = jd.init_params(config, jax.random.key(0), "float32")
save_file({k: np.asarray(v) for k, v in params_to_hf(params).items()},
          os.path.join(path, "model.safetensors"))
del params, path, config
blocks = json.load(open(sys.argv[1]))
namespace = {}
for i, block in enumerate(blocks):
    print(f"--- README block {i + 1}", flush=True)
    exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
print("all blocks ran")
"""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4  # API, the rollout, Generate, Sharding
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = dict(os.environ, **cpu_devices_env(8))
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "all blocks ran" in proc.stdout
