"""A Transformer language model with tied input/output embeddings and its report
(docs/registration_report.md)."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfacx

VOCAB, WIDTH, LENGTH = 64, 16, 8


# [tied-lm]
def forward(tokens):
    embed = hk.Embed(VOCAB, WIDTH, name="embed")
    h = embed(tokens)  # [batch, length, width]
    causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))[None, None]
    a = hk.LayerNorm(-1, True, True, name="ln_attn")(h)
    attention = hk.MultiHeadAttention(2, WIDTH // 2, w_init=hk.initializers.VarianceScaling())
    h = h + attention(a, a, a, mask=causal)
    m = hk.LayerNorm(-1, True, True, name="ln_mlp")(h)
    h = h + hk.nets.MLP([4 * WIDTH, WIDTH], activation=jax.nn.gelu, name="mlp")(m)
    h = hk.LayerNorm(-1, True, True, name="ln_final")(h)
    return h @ embed.embeddings.T  # the output projection reuses the embedding table


net = hk.without_apply_rng(hk.transform(forward))


def loss_fn(params, batch):
    tokens, targets = batch
    logits = net.apply(params, tokens).reshape(-1, VOCAB)
    logits = kfacx.register_softmax_cross_entropy_loss(logits, targets)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


tokens = np.random.default_rng(0).integers(0, VOCAB, (4, LENGTH + 1))
batch = (tokens[:, :-1], tokens[:, 1:].reshape(-1))
params = net.init(jax.random.key(0), batch[0])
estimator = kfacx.BlockDiagonalCurvature(loss_fn)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning: every use of every parameter is served
    estimator.init(jax.random.key(0), (params, batch))
print(estimator.report)
# [/tied-lm]
(entry,) = [e for e in estimator.report.entries if e.path == "embed/embeddings"]
assert (entry.tag, entry.block, entry.uses) == (
    "tied(embedding_tag, dense_tag)",
    "TiedKroneckerFactored",
    2,
), estimator.report
assert estimator.report.notes == () and estimator.report.unmatched == ()
print("OK")
