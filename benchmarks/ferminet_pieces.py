"""FermiNet's own computation (no K-FAC), timed piece by piece on the JAX it runs on.

Separates the JAX version from the K-FAC library in the LiH time ratio of
docs/benchmarks.md, "kfac-jax's clients on kfacx" (this script's figures:
docs/performance_notes.md, "kfac-jax's clients"): the same FermiNet code and the same
jnp operations, timed in each client virtualenv of benchmarks/clients.py. Run it with
a FermiNet tree on the path, pinned to one core so that XLA's thread pool does not blur
the figures::

    PYTHONPATH=/work/clients/trees/ferminet-kfacx JAX_PLATFORMS=cpu taskset -c 0 \\
        /work/clients/venvs/kfacx/bin/python benchmarks/ferminet_pieces.py
    PYTHONPATH=/work/clients/trees/ferminet-kfac-jax JAX_PLATFORMS=cpu taskset -c 0 \\
        /work/clients/venvs/peer/bin/python benchmarks/ferminet_pieces.py

Prints the median of each piece in microseconds, one line each.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def bench(name, f, *args, n=100):
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    for _ in range(5):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    print(f"{name:26s} {np.median(times) * 1e6:10.1f} us", flush=True)


def jnp_pieces():
    key = jax.random.PRNGKey(0)
    m = jax.random.normal(key, (256, 4, 4, 4))
    x = jax.random.normal(key, (1024, 32))
    w = jax.random.normal(key, (32, 32))
    bench("jnp.linalg.slogdet", jnp.linalg.slogdet, m)
    bench("jax.lax.linalg.lu", jax.lax.linalg.lu, m)
    bench("grad of slogdet", jax.grad(lambda m: jnp.linalg.slogdet(m)[1].sum()), m)
    bench("dense + tanh", lambda x, w: jnp.tanh(x @ w), x, w)
    bench("norm over last axis", lambda x: jnp.linalg.norm(x.reshape(256, 4, 8, 4), axis=-1), x)
    bench("jax.random.normal", lambda k: jax.random.normal(k, (256, 12)), key)


def ferminet_pieces():
    from ferminet import envelopes, hamiltonian, mcmc, networks
    from ferminet import loss as qmc_loss

    nspins, batch = (2, 2), 256
    charges = jnp.array([3.0, 1.0])
    atoms = jnp.array([[0.0, 0.0, 0.0], [3.015, 0.0, 0.0]])  # LiH
    network = networks.make_fermi_net(
        nspins,
        charges,
        ndim=3,
        determinants=4,
        envelope=envelopes.make_isotropic_envelope(),
        feature_layer=networks.make_ferminet_features(natoms=2, nspins=nspins, ndim=3),
        hidden_dims=((32, 8), (32, 8)),
    )
    key = jax.random.PRNGKey(0)
    params = network.init(key)

    def logabs(*a):
        return network.apply(*a)[1]

    batch_network = jax.vmap(logabs, in_axes=(None, 0, 0, 0, 0))
    data = networks.FermiNetData(
        positions=jax.random.normal(key, (batch, 12)),
        spins=jnp.tile(jnp.array([1.0, 1.0, -1.0, -1.0]), (batch, 1)),
        atoms=jnp.tile(atoms[None], (batch, 1, 1)),
        charges=jnp.tile(charges[None], (batch, 1)),
    )
    loss = qmc_loss.make_loss(logabs, hamiltonian.local_energy(network.apply, charges, nspins))
    bench(
        "FermiNet log|psi|, 256",
        lambda p, d: batch_network(p, d.positions, d.spins, d.atoms, d.charges),
        params,
        data,
    )
    bench("FermiNet energy + grad", jax.value_and_grad(loss, has_aux=True), params, key, data)
    bench(
        "FermiNet 10 MCMC steps",
        mcmc.make_mcmc_step(batch_network, batch // 4, steps=10),
        params,
        data,
        key,
        jnp.array(0.02),
    )


if __name__ == "__main__":
    print("jax", jax.__version__)
    jnp_pieces()
    ferminet_pieces()
