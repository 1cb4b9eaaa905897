"""A user extension of the FermiNet kind, written against kfac-jax's API only.

What a quantum Monte Carlo code adds to kfac-jax: a dense layer applied to every
particle (``jax.vmap`` over a leading axis) registered as its own variant, served by a
subclass of kfac-jax's dense block that folds the particles into the batch; graph
patterns that find it; a second variant for an "envelope" layer with a block written
from scratch on `kfac_jax.KroneckerFactored` (two factors per particle group, the state
in the ``inputs_factor`` / ``outputs_factor`` layout, its own cache and products); and
an energy whose gradient is a custom JVP, registering the wavefunction's distribution
inside the rule.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import kfacx
import kfacx.kfac_jax as kfac_jax

_dense = functools.partial(kfac_jax.tag_graph_matcher._dense, axes=1, with_reshape=False)
_per_particle_extractor = functools.partial(
    kfac_jax.tag_graph_matcher._dense_parameter_extractor, variant="per_particle_dense"
)


class PerParticleDenseBlock(kfac_jax.DenseTwoKroneckerFactored):
    """The dense block of a layer applied to every particle: particles become rows."""

    def fixed_scale(self):
        (x_shape,) = self.inputs_shapes
        return float(kfac_jax.utils.product(x_shape) // (x_shape[0] * x_shape[-1]))

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size
    ):
        [x] = estimation_data.primals.inputs
        [dy] = estimation_data.tangents.outputs
        assert x.shape[0] == batch_size
        rows = dataclasses.replace(
            estimation_data,
            primals=dataclasses.replace(
                estimation_data.primals, inputs=(x.reshape([-1, x.shape[-1]]),)
            ),
            tangents=dataclasses.replace(
                estimation_data.tangents, outputs=(dy.reshape([-1, dy.shape[-1]]),)
            ),
        )
        return super().update_curvature_matrix_estimate(
            state, rows, ema_old, ema_new, identity_weight, x.size // x.shape[-1]
        )


_per_particle = jax.vmap(_dense, in_axes=[0, [None, None]])
PER_PARTICLE_PATTERN = kfac_jax.tag_graph_matcher.GraphPattern(
    name="per_particle_dense_with_bias",
    tag_primitive=kfac_jax.layers_and_loss_tags.layer_tag,
    compute_func=_per_particle,
    parameters_extractor_func=_per_particle_extractor,
    example_args=[np.zeros([9, 11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
)
GRAPH_PATTERNS = (PER_PARTICLE_PATTERN,) + kfac_jax.tag_graph_matcher.DEFAULT_GRAPH_PATTERNS


def register_envelope(y, x, w):
    """An envelope ``y[b, i, g, o] = sum_k x[b, i, g, k] w[g, k, o]``: one small dense
    map per particle group ``g``."""
    return kfac_jax.register_dense(y, x, w, variant="envelope", kind="grouped")


_bmm = jax.vmap(jnp.matmul)


class EnvelopeBlock(kfac_jax.KroneckerFactored):
    """One pair of Kronecker factors per group ``g`` (a block diagonal over groups)."""

    def fixed_scale(self):
        return 1.0

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size
    ):
        del identity_weight
        [x] = estimation_data.primals.inputs  # [b, i, g, k]
        [dy] = estimation_data.tangents.outputs  # [b, i, g, o]
        assert batch_size == x.shape[0]
        inputs_cov = jnp.einsum("bigk,bigl->gkl", x, x) / (x.shape[0] * x.shape[1])
        outputs_cov = jnp.einsum("bigk,bigl->gkl", dy, dy) / x.shape[0]
        state.inputs_factor.update(inputs_cov, ema_old, ema_new)
        state.outputs_factor.update(outputs_cov, ema_old, ema_new)
        return state

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng, exact_powers_to_cache, cache_eigenvalues
        g, k, o = self.parameters_shapes[0]
        cache = {}
        for power in approx_powers_to_cache:
            cache[str(power)] = dict(
                inputs_factor=jnp.zeros([g, k, k]), outputs_factor=jnp.zeros([g, o, o])
            )
        return kfac_jax.KroneckerFactored.State(
            cache=cache,
            inputs_factor=kfac_jax.utils.WeightedMovingAverage.zeros_array((g, k, k)),
            outputs_factor=kfac_jax.utils.WeightedMovingAverage.zeros_array((g, o, o)),
        )

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        del exact_powers, eigenvalues
        for power in approx_powers:
            inverse = jax.vmap(
                lambda a, g: kfac_jax.utils.pi_adjusted_kronecker_inverse(
                    a, g, damping=identity_weight
                )
            )
            cache = state.cache[str(power)]
            cache["inputs_factor"], cache["outputs_factor"] = inverse(
                state.inputs_factor.value, state.outputs_factor.value
            )
        return state

    def multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        (w,) = vector  # [g, k, o]
        if power == 1:
            a, gg = state.inputs_factor.value, state.outputs_factor.value
            return (_bmm(_bmm(a, w), gg) + identity_weight * w,)
        if not use_cached:
            raise NotImplementedError("EnvelopeBlock: only cached inverses.")
        cache = state.cache[str(power)]
        return (_bmm(_bmm(cache["inputs_factor"], w), cache["outputs_factor"]),)

    def _to_dense_unscaled(self, state):
        a, gg = state.inputs_factor.value, state.outputs_factor.value
        return jax.scipy.linalg.block_diag(*[jnp.kron(a[i], gg[i]) for i in range(a.shape[0])])


# ----------------------------------------------------------------------------- the model

B, N, D, H, G, K = 8, 3, 6, 5, 2, 3


def init_params(seed: int = 0, dtype=jnp.float64) -> dict:
    rng = np.random.default_rng(seed)
    p = {
        "w1": rng.normal(size=(D, H)) / 2,
        "b1": rng.normal(size=(H,)) / 4,
        "env": rng.normal(size=(G, K, 2)) / 2,
        "w2": rng.normal(size=(H, 1)) / 2,
        "b2": np.zeros(1),
    }
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), p)


def batch(seed: int = 1, dtype=jnp.float64) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, N, D)), dtype)


def log_psi(params, positions):
    """Per walker: ``positions [N, D]`` -> a scalar (vmapped over walkers below)."""
    h = jnp.tanh(_per_particle_one(params, positions))  # [N, H]
    x = positions[:, : G * K].reshape(N, G, K)
    env = jnp.einsum("igk,gko->igo", x, params["env"])  # [N, G, O]
    return (jnp.sum(h, axis=0) @ params["w2"] + params["b2"])[0] - jnp.sum(env**2)


def _per_particle_one(params, positions):
    return positions @ params["w1"] + params["b1"][None]


def _network(params, positions, envelope):
    """The network on a batch; ``envelope(x, w)`` computes (and registers) the envelope."""
    h = jnp.tanh(jax.vmap(_per_particle_one, (None, 0))(params, positions))
    x = positions[..., : G * K].reshape(positions.shape[:2] + (G, K))
    env = envelope(x, params["env"])
    head = jnp.sum(h, axis=1) @ params["w2"] + params["b2"][None]
    return head[:, 0] - jnp.sum(env**2, (1, 2, 3))


def _kfac_jax_envelope(x, w):
    return register_envelope(jnp.einsum("bigk,gko->bigo", x, w), x, w)


def _kfacx_envelope(x, w):
    """The same envelope for kfacx's own API: a stacked dense layer (one weight per group)."""
    dnums = (((3,), (1,)), ((2,), (0,)))
    y = kfacx.register_dense(jax.lax.dot_general(x, w, dnums), x, w, dimension_numbers=dnums)
    return jnp.moveaxis(y, 0, 2)  # [G, B, N, O] -> [B, N, G, O]


def _local_energy(params, positions):
    """A stand-in for a local energy: like FermiNet's, it runs the network again inside a
    derivative with respect to the positions (``|grad log psi|^2``), a use of the weights
    that no registered loss depends on."""
    grad = jax.grad(log_psi, argnums=1)(params, positions)
    return -0.5 * jnp.sum(grad**2) + 0.5 * jnp.sum(positions**2)


def make_energy(envelope):
    """FermiNet's energy ``(params, key, data) -> (loss, aux)``, whose gradient is a custom
    JVP that registers the wavefunction's distribution (``envelope``: see `_network`)."""

    @jax.custom_jvp
    def total_energy(params, key, positions):
        del key
        e_l = jax.vmap(_local_energy, (None, 0))(params, positions)
        loss = kfac_jax.utils.pmean_if_pmap(jnp.mean(e_l), "walkers")
        variance = kfac_jax.utils.pmean_if_pmap(jnp.mean((e_l - loss) ** 2), "walkers")
        return loss, dict(variance=variance, local_energy=e_l)

    @total_energy.defjvp
    def _total_energy_jvp(primals, tangents):
        params, key, positions = primals
        loss, aux = total_energy(params, key, positions)
        diff = aux["local_energy"] - loss
        psi, psi_tangent = jax.jvp(
            lambda p, r: _network(p, r, envelope), (params, positions), (tangents[0], tangents[2])
        )
        kfac_jax.register_normal_predictive_distribution(psi[:, None])
        zeros = jax.tree.map(jnp.zeros_like, aux)
        return (loss, aux), (jnp.dot(psi_tangent, diff) / positions.shape[0], zeros)

    return total_energy


total_energy = make_energy(_kfac_jax_envelope)
native_total_energy = make_energy(_kfacx_envelope)
