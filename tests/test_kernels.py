"""jaxdecode.kernels: every Pallas Mosaic GPU kernel of the package is checked on CPU by lowering it
for CUDA (conftest.lower_for_cuda_text: ``jax.jit(f).trace(...).lower(lowering_platforms=
("cuda",))`` runs the whole Pallas -> Mosaic GPU translation: register layouts, reductions,
copies, shared memory sizes), in each kernel's test file; a kernel that uses an op or layout
Mosaic GPU cannot lower fails there, in CI, before it reaches a GPU. Not covered: PTX
compilation, register spills, speed. This file checks that the check has teeth, and the package's
``wait_for_inputs`` (the first statement of every kernel body).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import lower_for_cuda_text
from jaxdecode.kernels import wait_for_inputs

f32 = jnp.float32


def _copy_kernel(transpose: bool, pdl: bool):
    def body(x_gmem, o_gmem, o_smem):
        wait_for_inputs(interpret=not pdl)
        x = plgpu.load(x_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
        o_smem[...] = x.T if transpose else x
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 128), f32),
                        scratch_types=(plgpu.SMEM((128, 128), f32),), grid=(1,),
                        grid_names=("g",))


def test_a_kernel_mosaic_gpu_cannot_lower_fails_here():
    """The check is not vacuous: a transposed register tile (no Mosaic GPU lowering) raises,
    the same kernel without the transpose lowers."""
    assert "custom_call @mosaic_gpu" in lower_for_cuda_text(_copy_kernel(False, True),
                                                            ((128, 128), f32))
    with pytest.raises(Exception):
        lower_for_cuda_text(_copy_kernel(True, True), ((128, 128), f32))


def test_wait_for_inputs_marks_the_kernel_for_programmatic_dependent_launch():
    """Compiled (interpret=False) it marks the kernel (mosaic_gpu.uses_pdl); in the interpreter
    it is a no-op."""
    assert "mosaic_gpu.uses_pdl" in lower_for_cuda_text(_copy_kernel(False, True),
                                                        ((128, 128), f32))
    assert "mosaic_gpu.uses_pdl" not in lower_for_cuda_text(_copy_kernel(False, False),
                                                            ((128, 128), f32))
