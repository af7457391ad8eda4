"""T⁻¹ = (I + A)⁻¹ inside ``gated_delta.chunk_terms`` (XLA ops): candidate forms, their largest
error from float64 numpy on benign and adversarial chunks, and the terms' ms per layer.

    python benchmarks/chunk_inverse.py [0.8b:1:8192,9b:8:2048 | none]

``solve``: one triangular solve against I (the library's form). ``blocked``: X <- X - X L X over
diagonal blocks of 2, 4, ..., 32 (flash-linear-attention's ``solve_tril`` merge; what the terms
kernel does), at "highest" or default precision. ``blocked16``: 16 x 16 diagonal blocks by the
solve, then two merges. ``squarings``: (I - A)(I + A²)(I + A⁴)... ``none``: the error table only (runs on a CPU).
"""
import os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np
import jax, jax.numpy as jnp
import jaxdecode as jd
import jaxdecode.gated_delta as gd
sys.path.insert(0, "benchmarks")
from chunk_delta_rule import inputs, time_ms, unit_lower_inverse

HI = jax.lax.Precision.HIGHEST

def merge(x, a, s, precision=HI):
    """From X, the inverse of (I + A)'s diagonal blocks of s, the whole inverse: X <- X - X L X
    with L A's blocks just below them, s doubling up to C."""
    c = a.shape[-1]
    i = jnp.arange(c)[:, None]; j = jnp.arange(c)[None, :]
    while s < c:
        mask = ((i // s) % 2 == 1) & (j // s == i // s - 1)
        l = jnp.where(mask, a, 0.0)
        x = x - jnp.matmul(x, jnp.matmul(l, x, precision=precision), precision=precision)
        s *= 2
    return x

def blocked_inverse(a, precision=HI):
    return merge(jnp.eye(a.shape[-1], dtype=a.dtype), a, 1, precision)

def blocked16(a, precision=HI):
    """16x16 diagonal blocks by triangular solve, then two merge levels."""
    sh = a.shape[:-2]
    blocks = a.reshape(*sh, 4, 16, 4, 16)
    diag = jnp.stack([blocks[..., b, :, b, :] for b in range(4)], axis=-3)  # [..., 4, 16, 16]
    e16 = jnp.eye(16, dtype=a.dtype)
    inv16 = jax.scipy.linalg.solve_triangular(diag + e16, jnp.broadcast_to(e16, diag.shape), lower=True, unit_diagonal=True)
    x = jnp.zeros_like(a).reshape(*sh, 4, 16, 4, 16)
    for b in range(4):
        x = x.at[..., b, :, b, :].set(inv16[..., b, :, :])
    return merge(x.reshape(a.shape), a, 16, precision)

def solve_inv(a):
    c = a.shape[-1]; eye = jnp.eye(c, dtype=a.dtype)
    return jax.scipy.linalg.solve_triangular(a + eye, jnp.broadcast_to(eye, a.shape), lower=True, unit_diagonal=True)

METHODS = {"solve": solve_inv, "blocked hi": blocked_inverse,
           "blocked default": lambda a: blocked_inverse(a, None),
           "blocked16": blocked16, "squarings": lambda a: unit_lower_inverse(a + jnp.eye(a.shape[-1]))}

def patched(method):
    def solve(t, b, lower, unit_diagonal):
        return METHODS[method](t - jnp.eye(t.shape[-1], dtype=t.dtype))
    return solve

def run_with(method, f, *args):
    orig = gd.solve_triangular
    gd.solve_triangular = patched(method)
    try:
        return f(*args)
    finally:
        gd.solve_triangular = orig

def make_a(n, corr, beta_hi, seed=0):
    r = np.random.default_rng(seed)
    c, dk = 64, 128
    base = r.normal(size=(n, 1, dk))
    k = base * corr + r.normal(size=(n, c, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = r.uniform(beta_hi[0], beta_hi[1], size=(n, c))
    g = -r.uniform(0, 0.05, size=(n, c)); gam = np.cumsum(g, -1)
    dec = np.exp(np.minimum(gam[:, :, None] - gam[:, None, :], 0))
    a = np.tril(beta[:, :, None] * (k @ np.swapaxes(k, -1, -2)) * dec, -1)
    return a

print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}")
print("| inputs | " + " | ".join(METHODS) + " |")
for label, corr, bh in [("random keys, beta U(0,1)", 0.0, (0, 1)), ("correlated keys (0.5), beta U(0.5,1)", 0.5, (0.5, 1)),
                        ("correlated keys (2), beta U(0.9,1)", 2.0, (0.9, 1))]:
    a = make_a(256, corr, bh)
    ref = np.linalg.inv(np.eye(64) + a)
    errs = []
    for m, f in METHODS.items():
        x = np.asarray(jax.jit(f)(jnp.asarray(a, jnp.float32)), np.float64)
        errs.append(f"{np.abs(x - ref).max() / np.abs(ref).max():.1e}")
    print(f"| {label} (max|T^-1| {np.abs(ref).max():.1e}) | " + " | ".join(errs) + " |", flush=True)

print("| cell | " + " | ".join(f"terms {m}" for m in METHODS) + " |")
for cell in (sys.argv[1].split(",") if sys.argv[1] != "none" else []):
    name, b, t = cell.split(":")
    config = jd.Config.from_preset(f"qwen3.5-{name}")
    x = inputs(config, int(b), int(t))
    row = [cell]
    for m in METHODS:
        f = jax.jit(lambda *a, m=m: run_with(m, gd.chunk_terms, *a[:5], 64))
        ms, _ = time_ms(f, x)
        row.append(f"{ms:.2f}")
    print("| " + " | ".join(row) + " |", flush=True)
