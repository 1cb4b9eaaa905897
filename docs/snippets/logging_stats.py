"""Logging kfacx.Optimizer's per-step stats to a CSV file (docs/logging.md)."""

import csv
import io

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _data import classification

import kfacx

net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([16, 3])(x)))


def loss_fn(params, batch):
    x, labels = batch
    logits = kfacx.register_softmax_cross_entropy_loss(net.apply(params, x), labels)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


batch = classification()
key = jax.random.key(0)
params = net.init(key, batch[0][:1])
optimizer = kfacx.Optimizer(
    jax.value_and_grad(loss_fn, has_aux=True),
    value_func_has_aux=True,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=1.0,
    damping_adaptation_interval=5,
)
state = optimizer.init(params, key, batch)
csv_file = io.StringIO()  # open("stats.csv", "w", newline="") in a real run


# [log]
def to_row(stats):
    """A fetched stats dict as a CSV row: step first, aux leaves as aux/<name>."""
    row = {"step": int(stats["step"])}
    for name, value in stats.items():
        if name == "aux":
            for path, leaf in jax.tree_util.tree_leaves_with_path(value):
                row["aux/" + jax.tree_util.keystr(path, simple=True, separator="/")] = leaf.item()
        elif name != "step":
            row[name] = value.item()
    return row


writer, pending = None, []
for step in range(10):
    params, state, stats = optimizer.step(params, state, jax.random.fold_in(key, step), batch)
    pending.append(stats)  # still on the device: the loop does not wait for the step
    if len(pending) == 5:
        rows = [to_row(s) for s in jax.device_get(pending)]  # one transfer for 5 steps
        pending = []
        if writer is None:
            writer = csv.DictWriter(csv_file, fieldnames=list(rows[0]))
            writer.writeheader()
        writer.writerows(rows)
        last = rows[-1]
        print(f"step {last['step']}: loss {last['loss']:.3f}, rho {last['rho']:.2f}")
# [/log]

table = list(csv.DictReader(io.StringIO(csv_file.getvalue())))
print(csv_file.getvalue().splitlines()[0])
for column in ("rho", "quad_model_change"):
    finite = [int(r["step"]) for r in table if np.isfinite(float(r[column]))]
    print(f"{column} is a number on steps {finite}")
assert len(table) == 10 and float(table[-1]["loss"]) < float(table[0]["loss"])
print("OK")
