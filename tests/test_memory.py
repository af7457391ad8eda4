"""jaxdecode.memory: the state's bytes, the prefill's chunk plan under a budget, and the errors
for requests that cannot fit (before any device work), on a device faked to have little free."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

import jaxdecode as jd
from conftest import TINY, tiny
from jaxdecode import memory, sharding, step


def test_state_bytes_is_what_init_state_allocates():
    c = TINY
    for batch, max_len, dtype in ((2, 16, "bfloat16"), (3, 64, "float32")):
        state = jd.init_state(c, batch_size=batch, max_len=max_len, dtype=dtype)
        held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        assert memory.state_bytes(c, batch, max_len, dtype) == held
    e = 2
    conv = 2 * c.linear_conv_kernel_dim * c.linear_conv_dim * e
    rec = 2 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    kv = 2 * (2 * c.num_key_value_heads * 16 * c.head_dim * e)
    assert memory.state_bytes(c, 2, 16, "bf16") == 3 * (conv + rec) + kv + 2 * 4
    # with the MTP layer's pairs: one more attention layer's cache and a hidden state a row
    m = tiny(mtp_num_hidden_layers=1)
    state = jd.init_state(m, 3, 64, "bfloat16", mtp=True)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert memory.state_bytes(m, 3, 64, "bfloat16", mtp=True) == held
    assert held - memory.state_bytes(m, 3, 64, "bfloat16") == (
        memory.kv_cache_bytes(m, 3, 64, "bfloat16") + 3 * m.hidden_size * 2)


def test_free_bytes_is_none_on_the_cpu():
    if jax.default_backend() == "cpu":
        assert memory.free_bytes() is None
    else:
        assert memory.free_bytes() > 0


@pytest.fixture
def small_device(monkeypatch):
    """A default device with 1 MiB free."""
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 2**20)


def test_a_state_that_cannot_fit_is_a_value_error_before_allocating(small_device):
    with pytest.raises(ValueError, match=r"a state of 64 rows x 4096 positions needs "
                                         r"[0-9.]+ MiB but the device \(.*\) has 1.0 MiB free"):
        jd.init_state(TINY, 64, 4096)
    jd.init_state(TINY, 1, 16)  # a small one still fits


def test_a_sharded_state_is_checked_per_device(monkeypatch):
    mesh = sharding.make_mesh(data=1, model=1)
    need = memory.state_bytes(TINY, 4, 512, "float32")
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: need - 1)
    with pytest.raises(ValueError, match="a state shard of 4 rows x 512 positions over 1 devices"):
        sharding.init_state_sharded(TINY, mesh, 4, 512)


def test_a_prefill_over_data_devices_plans_the_rows_one_device_holds():
    """B rows over a "data" axis of 8: a device holds B / 8 of them, or all B where 8 does not
    divide B (whole on each data group: sharding.constrain_state; 3 prompts: 3, never 0, which
    plan_prefill refused). A stand-in mesh: plan_prefill reads only its shape and first
    device."""
    params = jd.init_params(TINY, jax.random.key(0))
    mesh = types.SimpleNamespace(shape={sharding.DATA: 8, sharding.MODEL: 1},
                                 devices=np.array(jax.devices()[:1]))
    for batch, per_device in ((3, 3), (8, 1), (9, 9), (16, 2)):
        assert (step.plan_prefill(params, batch, 256, 512, mesh=mesh)
                == step.plan_prefill(params, per_device, 256, 512)), batch


def test_generate_checks_its_state_and_prefill_before_device_work(monkeypatch):
    params = jd.init_params(TINY, jax.random.key(0))
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 2**20)  # 1 MiB beside them
    with pytest.raises(ValueError, match=r"generate's state \(8 prompt rows x 4096 positions\) "
                                         "needs"):
        jd.generate(params, [[1, 2, 3]] * 8, 8, max_len=4096)
    # num_samples: the prompts' state and the samples' forked from it, both held at the fork
    with pytest.raises(ValueError, match=r"generate's state \(2 prompt \+ 8 sample \(forked\) "
                                         r"rows x 4096 positions\) needs"):
        jd.generate(params, [[1, 2, 3]] * 2, 8, max_len=4096, num_samples=4)


def test_speculative_generate_counts_the_mtp_layers_cache(monkeypatch):
    """Speculative generate's state keeps the MTP layer's pairs (one more attention layer's K/V
    and a hidden state for every row), checked with the rest: free memory for the state alone,
    not both, is a ValueError naming them."""
    config = tiny(mtp_num_hidden_layers=1)
    params = jd.init_params(config, jax.random.key(0))
    state = memory.state_bytes(config, 8, 4096, "float32")
    mtp = memory.state_bytes(config, 8, 4096, "float32", mtp=True) - state
    assert memory.kv_cache_bytes(config, 8, 4096, "float32") < mtp < state
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: state + mtp // 2)
    budget = 2**30  # the prefill's activations are not what this checks
    jd.generate(params, [[1, 2, 3]] * 8, 4, max_len=4096, activation_budget=budget)  # plain fits
    with pytest.raises(ValueError, match=r"generate's state \(8 prompt rows x 4096 positions\) with "
                                         r"the MTP layer's pairs needs"):
        jd.generate(params, [[1, 2, 3]] * 8, 4, max_len=4096, activation_budget=budget,
                    num_speculative_tokens=2)


def test_plan_prefill_chunks_under_the_budget():
    c = jd.Config.from_preset("qwen3.5-9b")
    per_token = memory.prefill_token_bytes(c, "bfloat16")
    assert 100_000 < per_token < 2_000_000  # the 9B: hundreds of KB per token
    whole = memory.plan_prefill(c, 1, 2048, 4096, "bfloat16", budget=64 * 2**30)
    assert whole.prefill_chunk_size is None and whole.query_block == 512
    # 64 rows x 8k tokens into 8k-position caches with a 30 GiB budget: chunks, small blocks
    plan = memory.plan_prefill(c, 64, 8192, 8192, "bfloat16", budget=30 * 2**30)
    assert plan.prefill_chunk_size in (64, 128, 256, 512, 1024, 2048)
    assert plan.bytes <= 30 * 2**30 and plan.query_block < 512
    doubled = memory.plan_prefill(c, 64, 8192, 8192, "bfloat16", budget=60 * 2**30)
    assert doubled.prefill_chunk_size >= plan.prefill_chunk_size
    with pytest.raises(ValueError, match=r"a prefill of 64 rows needs [0-9.]+ GiB of activations "
                                         r"even in 64-token chunks \(max_len 8192\), over the "
                                         r"budget of 1.00 GiB"):
        memory.plan_prefill(c, 64, 8192, 8192, "bfloat16", budget=2**30)


def test_all_logits_that_cannot_fit_are_named(small_device):
    c = tiny(vocab_size=5000)
    with pytest.raises(ValueError, match=r"return_all_logits' \[4, 1000, 5000\] float32 logits "
                                         r"needs"):
        memory.plan_prefill(c, 4, 1000, 1024, "float32", return_all_logits=True)


def test_the_default_budget_is_half_of_what_is_free(monkeypatch):
    c = tiny(vocab_size=300)
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 2 * 10**9)
    plan = memory.plan_prefill(c, 8, 4096, 4096, "float32")
    assert plan.bytes <= 10**9
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: None)
    assert memory.plan_prefill(c, 8, 4096, 4096, "float32").bytes <= memory.HOST_BUDGET_BYTES


def test_plan_prefill_holds_the_16_bit_copy_of_fp8_weights():
    """XLA's FP8 forms dequantise one Linear at a time, and the MoE rounds form one layer's two
    expert stacks together: a prefill's plan counts the largest such copy beside its
    activations, and its error says how much of the total it is."""
    from jaxdecode import step
    dense = tiny(vocab_size=300)
    h, e = dense.hidden_size, 4  # float32 copies
    linears = {"mlp": dense.intermediate_size, "in_proj_qkv": dense.linear_conv_dim,
               "in_proj_z": dense.linear_num_value_heads * dense.linear_value_head_dim,
               "q_proj": 2 * dense.num_attention_heads * dense.head_dim,
               "o_proj": dense.num_attention_heads * dense.head_dim}
    moe = tiny(vocab_size=300, intermediate_size=0, num_experts=16, num_experts_per_tok=2,
               moe_intermediate_size=64, shared_expert_intermediate_size=32)
    for config, want in ((dense, max(linears.values()) * h * e),
                         (moe, 16 * (2 * 64 * h + h * 64) * e)):  # > any Linear of moe's
        params = jd.init_params(config, jax.random.key(0), "float32")
        fp8 = jd.quantize_fp8(params, (32, 32))
        assert step.dequantized_copy_bytes(params) == 0
        assert step.dequantized_copy_bytes(fp8) == want
        plain = step.plan_prefill(params, 2, 200, 256, activation_budget=2**40)
        held = step.plan_prefill(fp8, 2, 200, 256, activation_budget=2**40)
        assert held.bytes - plain.bytes == want
        with pytest.raises(ValueError, match=r"a prefill of 2 rows needs .* even in 64-token "
                                             r"chunks \(max_len 256\), [0-9.]+ [KM]iB of them "
                                             r"16-bit copies of FP8 weights, over the budget"):
            step.plan_prefill(fp8, 2, 200, 256, activation_budget=want)


def test_a_larger_budget_never_gives_a_smaller_chunk_or_an_error():
    """The query block and the chunk are chosen together: near the smallest budget a larger one
    once doubled the block first and then found no chunk (3 rows x 300 tokens of TINY: a plan at
    5.6 MiB, an error at 5.65)."""
    for config, batch, length, max_len, flash in ((TINY, 3, 300, 320, False),
                                                  (TINY, 2, 1000, 4096, False),
                                                  (TINY, 2, 1000, 4096, True)):
        last = None
        for budget in np.geomspace(2**20, 2**32, 400).astype(np.int64):
            try:
                plan = memory.plan_prefill(config, batch, length, max_len, "float32",
                                           budget=int(budget), flash=flash)
            except ValueError:
                assert last is None, (budget, last)  # no error once a smaller budget had a plan
                continue
            assert plan.bytes <= budget
            chunk = plan.prefill_chunk_size or length
            assert last is None or chunk >= last, (budget, chunk, last)
            last = chunk
        assert last == length
    plan = memory.plan_prefill(TINY, 3, 300, 320, "float32", budget=int(5.65 * 2**20))
    assert plan.prefill_chunk_size == 64


def test_plan_prefill_refuses_nonsense():
    for kw, message in ((dict(budget=0), "budget=0 must be a positive"),
                        (dict(batch_size=0), "batch_size=0 must be >= 1"),
                        (dict(length=0), "length=0 must be >= 1")):
        args = dict(config=TINY, batch_size=2, length=100, max_len=128, dtype="float32") | kw
        with pytest.raises(ValueError, match=message):
            memory.plan_prefill(**args)
    with pytest.raises(ValueError, match=r"even in one call of its 40 tokens \(max_len 64\)"):
        memory.plan_prefill(TINY, 2, 40, 64, "float32", budget=1000)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the host check is the CPU's")
def test_on_the_cpu_a_state_is_checked_against_the_hosts_available_memory(monkeypatch):
    assert memory.free_bytes() is None and memory.host_available_bytes() > 0
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2**20)
    with pytest.raises(ValueError, match=r"needs [0-9.]+ MiB but the host \(cpu devices\) has "
                                         r"1.0 MiB free"):
        jd.init_state(TINY, batch_size=64, max_len=4096)


def test_fork_checks_the_new_state_before_allocating(monkeypatch):
    state = jd.init_state(TINY, 2, 512)
    need = 10 * memory.state_bytes(TINY, 2, 512, "float32")
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: need - 1)
    with pytest.raises(ValueError, match=r"fork's state of 20 rows x 512 positions needs"):
        jd.fork(state, 10)
    assert jd.fork(state, 9).batch_size == 18


def _held(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def test_params_bytes_is_what_the_params_hold():
    """``params.params_bytes`` (init_params' and load_checkpoint's check) against the bytes of
    the arrays: dense and MoE (with its MTP layer), float32 and bf16, and block FP8 (the
    quantised leaves one byte a value plus a float32 scale a block, expert stacks per expert)."""
    from jaxdecode import params as params_lib, quantization
    moe = tiny(vocab_size=300, intermediate_size=0, num_experts=16, num_experts_per_tok=2,
               moe_intermediate_size=64, shared_expert_intermediate_size=32,
               mtp_num_hidden_layers=1)
    for config in (tiny(vocab_size=300), moe):
        fp8_leaves = {name for name in params_lib.param_specs(config)
                      if quantization.is_quantized_leaf(name)}
        for dtype in ("float32", "bfloat16"):
            params = jd.init_params(config, jax.random.key(0), dtype)
            assert params_lib.params_bytes(config, dtype) == _held(params)
            fp8 = jd.quantize_fp8(params, (32, 48))
            assert params_lib.params_bytes(config, dtype, fp8_leaves, (32, 48)) == _held(fp8)


def test_weights_that_cannot_fit_are_refused_before_any_is_created(monkeypatch, tmp_path):
    """init_params and load_checkpoint (onto the default device, or a mesh: a device's shard)
    name the bytes needed and free before creating or reading a weight; jax.eval_shape of
    init_params allocates nothing and is not checked."""
    from jaxdecode import params as params_lib
    from test_checkpoint import write_checkpoint
    config = tiny(vocab_size=300)  # 0.92 MiB in float32
    path = write_checkpoint(tmp_path / "ck", jd.init_params(config, jax.random.key(0)))
    need = memory._size(params_lib.params_bytes(config, "float32"))
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 2**19)  # 0.5 MiB free
    with pytest.raises(ValueError, match=rf"init_params' weights \(float32\) needs {need} but "
                                         r"the device .* has 0.5 MiB free; use a mesh"):
        jd.init_params(config, jax.random.key(0))
    shapes = jax.eval_shape(lambda k: jd.init_params(config, k), jax.random.key(0))
    assert shapes.embed_tokens.shape == (300, config.hidden_size)
    with pytest.raises(ValueError, match=rf"the checkpoint's weights \(float32\) needs {need} but "
                                         r"the device .* has 0.5 MiB free; load onto a mesh"):
        jd.load_checkpoint(path, "float32")
    with pytest.raises(ValueError, match=rf"a shard of the checkpoint's weights \(float32\) over 1 "
                                         rf"devices needs {need} but the device .* has 0.5 MiB "
                                         r"free; use more 'model' devices \(or quantize='fp8'\)"):
        jd.load_checkpoint(path, "float32", mesh=sharding.make_mesh(1, 1))


@pytest.mark.perf
def test_a_moe_prefill_holds_one_layers_expert_outputs_at_a_time():
    """The MoE rounds form's [P, H] output buffer (P = tokens x k pairs) is live for its own
    layer only: XLA merged the layers' constant zero starts into one fusion at the program's
    start, all layers' buffers live at once, so a prefill's temporaries grew by one [P, H] a
    layer (the 35B-A3B FP8, 8 x 8k tokens: 88 GiB on an H200, over its free memory;
    benchmarks/RESULTS.md, session 48). Compiled for the CPU: 4 layers against 8."""
    rows, tokens, k, hidden = 2, 1024, 8, 256  # k x hidden: the [P, H] buffer dominates
    temp = {}
    for layers in (4, 8):
        config = tiny(intermediate_size=0, num_experts=16, num_experts_per_tok=k,
                      moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      hidden_size=hidden, num_hidden_layers=layers,
                      layer_types=TINY.layer_types * (layers // 4))
        params = jax.eval_shape(lambda: jd.init_params(config, jax.random.key(0), "float32"))
        state = jax.eval_shape(lambda: jd.init_state(config, rows, tokens + 64, "float32"))
        run = step.jit_prefill(config, None, False, 512, jd.Kernels(), False)
        compiled = run.lower(params, state, jax.ShapeDtypeStruct((rows, tokens), np.int32),
                             jax.ShapeDtypeStruct((rows,), np.int32)).compile()
        temp[layers] = compiled.memory_analysis().temp_size_in_bytes
    pair_outputs = rows * tokens * k * hidden * 4  # one layer's [P, H] float32
    assert (temp[8] - temp[4]) / 4 < pair_outputs / 2, (temp, pair_outputs)
