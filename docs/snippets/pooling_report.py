"""An attention-pooling head and its registration report (docs/registration_report.md)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfacx


# [pooling]
class MAPHead(nn.Module):
    """Multi-head attention pooling: a learned probe, tiled over the batch, attends
    to the tokens (the pooling head of big_vision's ViT)."""

    classes: int

    @nn.compact
    def __call__(self, tokens):
        batch, _, width = tokens.shape
        probe = self.param("probe", nn.initializers.normal(0.5), (1, 1, width))
        query = jnp.tile(probe, [batch, 1, 1])
        pooled = nn.MultiHeadDotProductAttention(num_heads=2)(query, tokens)[:, 0]
        return nn.Dense(self.classes)(nn.LayerNorm()(pooled))


model = MAPHead(classes=3)


def loss_fn(params, batch):
    tokens, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(model.apply(params, tokens), labels)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


rng = np.random.default_rng(0)
batch = (jnp.asarray(rng.normal(size=(16, 5, 8)), jnp.float32), jnp.asarray(rng.integers(0, 3, 16)))
params = model.init(jax.random.key(0), batch[0])
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # every parameter is matched: no warning
    estimator.init(jax.random.key(0), (params, batch))
print(estimator.report)
# [/pooling]
assert estimator.report.unmatched == () and estimator.report.notes == ()
print("OK")
