"""jaxdecode.kernels.choice: the Kernels value, what choose_kernels decides, and the two call
sites the model uses (run with explicit Kernels: the Pallas kernels in the Mosaic GPU
interpreter on CPU, against float64 references).

choose_kernels decides on the host from the device's compute capability; these tests fake a
Hopper GPU by monkeypatching ``choice._compute_capability`` (and clear choose_kernels' cache
around each test, so a decision made under one fake is never seen under another)."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxdecode as jd
from conftest import (ATTENTION_TOL, assert_attention_close, assert_inactive_rows_untouched,
                      assert_rel_close, attention_inputs, attention_reference_f64,
                      lower_for_cuda_text, numpy_core, random_core_inputs, tiny)
from jaxdecode import sharding
from jaxdecode.kernels import choice

bf16, f32 = jnp.bfloat16, jnp.float32

# Shapes every kernel takes (head_dim 64, dk = dv = 128, Kc = 4).
SUPPORTED = tiny(head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128)
CORE, RULE = choice.DELTANET_CORE_MAX_BATCH, choice.DELTA_RULE_MIN_BATCH


@pytest.fixture(autouse=True)
def _fresh_choices():
    choice.choose_kernels.cache_clear()
    yield
    choice.choose_kernels.cache_clear()


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(choice, "_compute_capability", lambda device: (9, 0))


def fake_mesh(data: int, model: int) -> Mesh:
    """A ("data", "model") mesh of the one CPU device repeated: enough for choose_kernels, which
    reads only the mesh's shape and first device (never run on it)."""
    devices = np.array([jax.devices()[0]] * (data * model), dtype=object).reshape(data, model)
    return Mesh(devices, sharding.AXIS_NAMES, axis_types=(AxisType.Auto, AxisType.Auto))


def kernels(attention="xla", deltanet="xla", delta_rule="xla", mesh=None,
            prefill_attention=None, prefill_delta_rule=None, batch_invariant=False,
            fp8_linear="xla", verify_delta_rule="xla", verify_attention=None):
    """What choose_kernels returns: interpret=False (it compiles for the GPU it found); the
    prefill kernels where the decode attention kernel is (None), unless given; the few-query
    attention kernel too, unless batch-invariant."""
    return choice.Kernels(attention=attention, deltanet=deltanet, delta_rule=delta_rule,
                          prefill_attention=prefill_attention or attention,
                          prefill_delta_rule=prefill_delta_rule or attention, interpret=False,
                          mesh=mesh, batch_invariant=batch_invariant, fp8_linear=fp8_linear,
                          verify_delta_rule=verify_delta_rule,
                          verify_attention=verify_attention or (
                              "xla" if batch_invariant else attention))


def hopper_kernels(**kw):
    """choose_kernels on Hopper for a 16-bit model on one device: the FP8 linear kernel and the
    verify step's delta-rule kernel too (unless given)."""
    return kernels(**{"fp8_linear": "pallas", "verify_delta_rule": "pallas", **kw})


# ----- the value ----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("attention", "triton"), ("deltanet", "bogus"),
                                          ("delta_rule", "reference"), ("attention", "auto")])
def test_kernels_rejects_unknown_choices(field, value):
    with pytest.raises(ValueError, match=rf"Kernels.{field}='{value}' must be one of "
                                         r"\('pallas', 'xla'\)"):
        choice.Kernels(**{field: value})


def test_kernels_rejects_the_one_kernel_core_on_a_mesh():
    mesh = sharding.make_mesh(1, 1)
    with pytest.raises(ValueError, match=r"Kernels\(deltanet='pallas'\) does not run on a mesh"):
        choice.Kernels(deltanet="pallas", mesh=mesh)
    # the per-device kernels do
    k = choice.Kernels(attention="pallas", delta_rule="pallas", mesh=mesh)
    assert k.mesh is mesh


def test_kernels_rejects_few_query_attention_kernel_when_batch_invariant():
    with pytest.raises(ValueError, match=r"verify_attention='pallas'\) is not batch-invariant"):
        choice.Kernels(attention="pallas", verify_attention="pallas", batch_invariant=True)


def test_kernels_is_a_frozen_hashable_static():
    assert choice.XLA == choice.Kernels() == choice.Kernels("xla", "xla", "xla")
    assert hash(choice.Kernels(attention="pallas")) == hash(choice.Kernels(attention="pallas"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.XLA.attention = "pallas"
    # interpret: None means "not on a GPU", decided when a step is traced (constructing a
    # Kernels, as importing jaxdecode does, must not start the backend: test_import_graph.py)
    assert choice.Kernels().interpret is None
    assert choice._interpret(choice.Kernels()) is (jax.default_backend() != "gpu")
    assert choice._interpret(choice.Kernels(interpret=False)) is False
    assert choice._interpret(choice.Kernels(interpret=True)) is True
    assert jd.Kernels is choice.Kernels and jd.choose_kernels is choice.choose_kernels


# ----- choose_kernels -----------------------------------------------------------------------

@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU decision")
@pytest.mark.parametrize("batch", [1, 3, 4, 8, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_runs_everything_in_xla_silently(batch, dtype):
    assert choice._compute_capability(jax.devices()[0]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = choice.choose_kernels(SUPPORTED, batch, dtype=dtype)
        assert got == kernels()
        assert choice.choose_kernels(SUPPORTED, batch, dtype=dtype,
                                     mesh=sharding.make_mesh(1, 1)) == kernels(
            mesh=sharding.make_mesh(1, 1))


def test_kernels_take_the_params_mesh():
    """for_mesh: kernels without a mesh get the params' mesh (the step lays out its state by
    it); kernels of another mesh, or of a mesh for params on one device, are refused."""
    mesh, other = fake_mesh(2, 1), fake_mesh(1, 2)
    assert choice.for_mesh(choice.XLA, None) is choice.XLA
    assert choice.for_mesh(choice.Kernels(attention="pallas"), mesh) == choice.Kernels(
        attention="pallas", mesh=mesh)
    on = choice.Kernels(mesh=mesh)
    assert choice.for_mesh(on, mesh) is on
    for kernels, params_mesh in ((on, other), (on, None)):
        with pytest.raises(ValueError, match="kernels.mesh is .* but the params are on"):
            choice.for_mesh(kernels, params_mesh)
    for kernels in (choice.Kernels(deltanet="pallas"), choice.Kernels(batch_invariant=True)):
        with pytest.raises(ValueError, match="the params are on a mesh .* does not run on a mesh"):
            choice.for_mesh(kernels, mesh)


def test_row_specs_drop_data_only_for_rows_that_do_not_divide_it():
    """One rule for the kernels' shard_map specs and the state's layout."""
    specs = (P("data", "model"), {"c": P("data", None, "model")})
    assert choice.row_specs(specs, 4, fake_mesh(2, 1)) is specs
    assert choice.row_specs(specs, 3, None) is specs
    assert choice.row_specs(specs, 3, fake_mesh(1, 2)) is specs  # "data" of 1 divides any rows
    assert choice.row_specs(specs, 3, fake_mesh(2, 1)) == (P(None, "model"),
                                                           {"c": P(None, None, "model")})


@pytest.mark.parametrize("batch", [0, -1, 2.0, True])
def test_choose_kernels_names_a_batch_size_that_is_not_one(batch):
    with pytest.raises(ValueError, match="batch_size=.* must be a positive int"):
        choice.choose_kernels(SUPPORTED, batch)


@pytest.mark.parametrize("batch", [1, 2, CORE - 1, CORE, RULE - 1, RULE, 64])
def test_hopper_choice_by_batch(hopper, batch):
    """Attention always Pallas; the one-kernel DeltaNet core below DELTANET_CORE_MAX_BATCH
    rows; from there XLA's DeltaNet with the one-pass delta-rule kernel from
    DELTA_RULE_MIN_BATCH rows."""
    assert (CORE, RULE) == (4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every shape is supported: no warning
        got = choice.choose_kernels(SUPPORTED, batch, dtype="bfloat16")
    assert got == hopper_kernels(attention="pallas",
                                 deltanet="pallas" if batch < CORE else "xla",
                                 delta_rule="pallas" if batch >= RULE else "xla")
    assert got.interpret is False


def test_hopper_batch_invariant_choice_is_one_for_every_batch(hopper):
    """batch_invariant: the attention kernel and the one-kernel DeltaNet core for any batch (one
    row's tiling, chosen at the call sites), never the batch-dependent thresholds."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = {choice.choose_kernels(SUPPORTED, b, dtype="bfloat16", batch_invariant=True)
               for b in (1, CORE, RULE, 64, 65)}
    assert got == {kernels(attention="pallas", deltanet="pallas", batch_invariant=True)}


@pytest.mark.parametrize("data, model, batch, rule", [
    (1, 1, 1, "xla"), (2, 1, 2 * (RULE - 1), "xla"), (2, 1, 2 * RULE, "pallas"),
    (4, 2, 4 * RULE, "pallas"), (8, 1, RULE, "xla"), (1, 2, RULE, "pallas"),
    (2, 1, RULE + 1, "pallas")])
def test_hopper_choice_on_a_mesh_is_per_device(hopper, data, model, batch, rule):
    """On a mesh: never the one-kernel core (not even at one row per device), the batch
    threshold counts rows per device (batch / data, or every row where they do not divide
    "data": sharding.constrain_state), the FP8 linear kernel per device."""
    mesh = fake_mesh(data, model)
    config = dataclasses.replace(SUPPORTED, num_attention_heads=8, num_key_value_heads=4,
                                 linear_num_key_heads=4, linear_num_value_heads=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = choice.choose_kernels(config, batch, dtype="bfloat16", mesh=mesh)
    assert got == kernels(attention="pallas", deltanet="xla", delta_rule=rule, mesh=mesh,
                          verify_delta_rule="pallas", fp8_linear="pallas")
    assert got.mesh is mesh


@pytest.mark.parametrize("change, batch, op, why, want", [
    (dict(head_dim=32), 1, "decode attention", "head_dim=32",
     hopper_kernels(deltanet="pallas", prefill_delta_rule="pallas")),
    (dict(linear_key_head_dim=32), 1, "the Gated DeltaNet core", "not a multiple of 64",
     hopper_kernels(attention="pallas", prefill_delta_rule="xla", verify_delta_rule="xla")),
    (dict(linear_key_head_dim=32), RULE, "the gated delta rule", "not a multiple of 64",
     hopper_kernels(attention="pallas", prefill_delta_rule="xla", verify_delta_rule="xla")),
    (dict(linear_value_head_dim=44), RULE, "the gated delta rule", "not a multiple of 8",
     hopper_kernels(attention="pallas", prefill_delta_rule="xla", verify_delta_rule="xla")),
    (dict(linear_value_head_dim=96), RULE, "the prefill's delta rule",
     r"\(the kernels take 64 or 128\)",
     hopper_kernels(attention="pallas", delta_rule="pallas", prefill_delta_rule="xla")),
], ids=["attention-head-dim", "core-dk", "delta-rule-dk", "delta-rule-dv", "prefill-rule-dv"])
def test_hopper_unsupported_shape_warns_once_and_falls_back(hopper, change, batch, op, why,
                                                            want):
    config = dataclasses.replace(SUPPORTED, **change)
    with pytest.warns(UserWarning, match=rf"jaxdecode: {op} runs in XLA instead of its Pallas "
                                         rf"kernel: .*{why}") as record:
        got = choice.choose_kernels(config, batch, dtype="bfloat16")
        again = choice.choose_kernels(config, batch, dtype="bfloat16")  # decided once
    assert got == again == want
    # head_dim 32 fits neither attention kernel, dv 44 neither delta-rule kernel, dk 32 neither
    # the one-token DeltaNet kernel nor the prefill's: one warning each
    ops = 2 if (op == "decode attention" or change.get("linear_value_head_dim") == 44
                or change.get("linear_key_head_dim") == 32) else 1
    assert len(record) == ops, [str(w.message) for w in record]


def test_hopper_unsupported_dtype_warns_and_falls_back(hopper):
    with pytest.warns(UserWarning, match="the Gated DeltaNet core runs in XLA .*model dtype "
                                         "float16"):
        got = choice.choose_kernels(SUPPORTED, 1, dtype="float16")
    assert got == hopper_kernels(attention="pallas")  # the attention kernel takes float16


def test_older_gpu_warns_and_runs_xla(monkeypatch):
    monkeypatch.setattr(choice, "_compute_capability", lambda device: (8, 0))
    with pytest.warns(UserWarning, match=r"compute capability 8.0\) is older than Hopper"):
        got = choice.choose_kernels(SUPPORTED, 1, dtype="bfloat16")
    assert got == kernels()


@pytest.mark.perf
@pytest.mark.parametrize("batch", [1, CORE - 1, CORE, RULE])
def test_hopper_choice_lowers_to_what_it_says(hopper, batch):
    """The chosen DeltaNet kernels, lowered for CUDA on CPU: the one-kernel core below CORE rows
    (its L2 norms inside the kernel: no rsqrt outside); from CORE XLA's conv, norms and gating,
    with the delta rule a kernel from RULE rows."""
    k = choice.choose_kernels(SUPPORTED, batch, dtype="bfloat16")
    c = SUPPORTED
    args = random_core_inputs(4, batch, c.linear_num_key_heads, c.linear_num_value_heads,
                              c.linear_key_head_dim, c.linear_value_head_dim,
                              c.linear_conv_kernel_dim, [True] * batch, dtype=bf16)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    text = lower_for_cuda_text(
        lambda *x: choice.deltanet_decode(k, *x, num_key_heads=c.linear_num_key_heads), *specs)
    fused = batch < CORE
    assert ("mosaic_gpu" in text) == (fused or batch >= RULE)
    assert ("stablehlo.rsqrt" not in text) == fused, "norms outside the kernel: XLA's form"


# ----- the call sites, with explicit Kernels ------------------------------------------------

ATTENTION_KERNELS = {"xla": choice.XLA, "pallas": choice.Kernels(attention="pallas"),
                     "xla-invariant": choice.Kernels(batch_invariant=True),
                     "pallas-invariant": choice.Kernels(attention="pallas",
                                                        batch_invariant=True)}
INTERPRETED = pytest.mark.slow  # the Pallas kernels in the Mosaic GPU interpreter


@pytest.mark.parametrize("name", [pytest.param(n, marks=[INTERPRETED] if "pallas" in n else [])
                                  for n in ATTENTION_KERNELS])
def test_decode_attention_runs_what_kernels_says(name):
    """"xla" is decode_attention_reference bit for bit; "pallas" the kernel (the interpreter on
    CPU); both against float64."""
    from jaxdecode.kernels import decode_attention as da
    k = ATTENTION_KERNELS[name]
    q, kc, vc, kv_len = attention_inputs(8, (8, 2), 64, 128, (100, 3), f32)
    fn = jax.jit(lambda *a: choice.decode_attention(k, *a))
    out = fn(q, kc, vc, kv_len)
    assert_attention_close(out, attention_reference_f64(q, kc, vc, kv_len), kv_len,
                           ATTENTION_TOL[f32])
    if name == "xla":
        np.testing.assert_array_equal(out, jax.jit(da.decode_attention_reference)(q, kc, vc,
                                                                                  kv_len))
    text = fn.lower(q, kc, vc, kv_len).as_text()
    assert ("mosaic_gpu" in text) == ("pallas" in name and not choice._interpret(k))


@INTERPRETED
def test_decode_attention_kernel_per_device_on_a_mesh():
    """With a mesh the kernel runs under shard_map (here a one-device mesh, interpreted)."""
    mesh = sharding.make_mesh(1, 1)
    k = choice.Kernels(attention="pallas", mesh=mesh)
    q, kc, vc, kv_len = attention_inputs(9, (8, 2), 64, 128, (65, 0), bf16)
    out = jax.jit(lambda *a: choice.decode_attention(k, *a))(q, kc, vc, kv_len)
    assert_attention_close(out, attention_reference_f64(q, kc, vc, kv_len), kv_len,
                           ATTENTION_TOL[bf16])


@INTERPRETED
def test_few_query_attention_runs_the_decode_kernel_on_and_off_a_mesh():
    """choice.prefill_attention with verify_attention="pallas": T·G <= 64 queries through the
    decode-attention kernel (one device and under shard_map), more through the prefill path;
    both against float64 (each query sees the keys up to its position)."""
    from test_kernels_decode_attention import check_queries, query_inputs
    rows = ((0, 4), (60, 64), (296, 300))
    for queries, mesh in ((4, None), (4, sharding.make_mesh(1, 1)), (40, None)):
        rows_t = tuple((n - queries if n >= queries else 0, n if n >= queries else queries)
                       for _, n in rows)
        q, kc, vc, kv_len, start = query_inputs(14, (8, 2), 64, queries, f32, rows_t)
        k = choice.Kernels(verify_attention="pallas", mesh=mesh)
        fn = jax.jit(lambda *a: choice.prefill_attention(k, *a))
        out = fn(q, kc, vc, start, kv_len - start)
        check_queries(out, q, kc, vc, kv_len, start, f32)
        hlo = fn.lower(q, kc, vc, start, kv_len - start).as_text()
        assert ("decode_attention" in hlo) == (queries == 4), (queries, mesh)


DELTANET_KERNELS = {"xla": choice.XLA, "core-pallas": choice.Kernels(deltanet="pallas"),
                    "delta-rule-pallas": choice.Kernels(delta_rule="pallas"),
                    "xla-invariant": choice.Kernels(batch_invariant=True),
                    "core-pallas-invariant": choice.Kernels(deltanet="pallas",
                                                            batch_invariant=True),
                    "delta-rule-pallas-invariant": choice.Kernels(delta_rule="pallas",
                                                                  batch_invariant=True)}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[INTERPRETED] if "pallas" in n else [])
                                  for n in DELTANET_KERNELS])
def test_deltanet_decode_runs_what_kernels_says(name):
    """Every choice against the float64 core, with an inactive row left untouched."""
    k = DELTANET_KERNELS[name]
    args = random_core_inputs(3, 2, 1, 2, 128, 128, 4, [True, False])
    o, new_conv, new_state = jax.jit(lambda *x: choice.deltanet_decode(
        k, *x, num_key_heads=1))(*args)
    want_o, want_conv, want_state = numpy_core(*args, num_key_heads=1)
    assert_rel_close(o, want_o, 2e-5, "o")
    assert_rel_close(new_state, want_state, 2e-5, "recurrent_state")
    np.testing.assert_array_equal(np.asarray(new_conv), want_conv)
    assert_inactive_rows_untouched(args, o, new_conv, new_state)


@INTERPRETED
def test_delta_rule_kernel_per_device_on_a_mesh():
    mesh = sharding.make_mesh(1, 1)
    k = choice.Kernels(delta_rule="pallas", mesh=mesh)
    args = random_core_inputs(5, 2, 2, 4, 64, 64, 4, [False, True])
    got = jax.jit(lambda *x: choice.deltanet_decode(k, *x, num_key_heads=2))(*args)
    want = numpy_core(*args, num_key_heads=2)
    assert_rel_close(got[0], want[0], 2e-5, "o")
    assert_rel_close(got[2], want[2], 2e-5, "recurrent_state")
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])


def delta_rule_case(seed, b, t, h, dk, dv):
    """Fresh random float32 delta-rule inputs (q, k, v, g, beta, state) and the float64
    token-by-token recurrence's (o [B, T, H, dv], the state after each token [B, T, H, dk, dv])
    (HF torch_recurrent_gated_delta_rule)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.nn.standardize(jax.random.normal(keys[0], (b, t, h, dk)), axis=-1) * dk**-1
    k = jax.nn.standardize(jax.random.normal(keys[1], (b, t, h, dk)), axis=-1) * dk**-0.5
    v = jax.random.normal(keys[2], (b, t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (b, t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
    s0 = jax.random.normal(keys[5], (b, h, dk, dv))
    args = (q, k, v, g, beta, s0)
    qn, kn, vn, gn, bn, s = (np.asarray(x, np.float64) for x in args)
    want_o, want_s = np.zeros(vn.shape), np.zeros((b, t, h, dk, dv))
    for i in range(t):
        s = s * np.exp(gn[:, i])[..., None, None]
        d = bn[:, i, :, None] * (vn[:, i] - np.einsum("bhkv,bhk->bhv", s, kn[:, i]))
        s = s + kn[:, i, :, :, None] * d[:, :, None, :]
        want_o[:, i] = np.einsum("bhkv,bhk->bhv", s, qn[:, i])
        want_s[:, i] = s
    return args, want_o, want_s


@INTERPRETED
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_prefill_delta_rule_runs_what_kernels_says_on_and_off_a_mesh(impl):
    """choice.chunk_gated_delta_rule, one device and under shard_map (a one-device mesh),
    against the float64 recurrence."""
    args, want_o, want_s = delta_rule_case(12, 2, 70, 2, 64, 64)
    for mesh in (None, sharding.make_mesh(1, 1)):
        kern = choice.Kernels(prefill_delta_rule=impl, mesh=mesh)
        o, state = jax.jit(lambda *x: choice.chunk_gated_delta_rule(kern, *x))(*args)
        assert_rel_close(o, want_o, 2e-5, f"o (mesh={mesh is not None})")
        assert_rel_close(state, want_s[:, -1], 2e-5, f"final state (mesh={mesh is not None})")


@INTERPRETED
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_gated_delta_states_runs_what_kernels_says_on_and_off_a_mesh(impl):
    """choice.gated_delta_states (a verify step's few tokens, every state kept), one device and
    under shard_map (a one-device mesh), against the float64 recurrence."""
    args, want_o, want_s = delta_rule_case(13, 2, 3, 2, 64, 64)
    for mesh in (None, sharding.make_mesh(1, 1)):
        kern = choice.Kernels(verify_delta_rule=impl, mesh=mesh)
        fn = jax.jit(lambda *x: choice.gated_delta_states(kern, *x))
        o, states = fn(*args)
        assert_rel_close(o, want_o, 2e-5, f"o (mesh={mesh is not None})")
        assert_rel_close(states, want_s, 2e-5, f"states (mesh={mesh is not None})")
        if impl == "xla":  # unrolled: no loop (on a GPU, a host round trip per token)
            assert "while" not in fn.lower(*args).as_text()
