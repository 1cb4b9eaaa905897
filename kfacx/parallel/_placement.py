"""Where `kfacx.Optimizer`'s step runs: one device, `jax.pmap`, or a device mesh.

Four placements share one pure step function (`kfacx.Optimizer.unstaged_step`), whose
leading arguments are named in `STEP_INPUTS`:

* ``single``: ``jax.jit`` on the default device;
* ``pmap``: ``jax.pmap`` (``multi_device=True``) over the devices of all processes;
  each process's inputs carry a leading axis of its local devices (see
  `kfacx.parallel`);
* ``mesh``: ``jax.jit`` with the batch sharded over the data axis of a
  `jax.sharding.Mesh` and everything else replicated; the compiler partitions
  the single-device program (GSPMD), and the inverse refresh runs in a
  `jax.shard_map` over the data axis so that it can be distributed
  (`kfacx.parallel._distributed.placed_refresh`);
* ``shard_map``: ``jax.jit`` of a `jax.shard_map` over the data axis; the step
  sees its device's shard of the batch and averages explicitly over the axis,
  exactly like the pmapped step.

In the mesh placements inputs are global arrays: the batch's leading axis is
the global batch, and one rng key serves all devices (``shard_map`` folds the
device index into it, so devices draw different samples). Runs of several
processes (as on several hosts) use the same code after
`jax.distributed.initialize`, with a mesh over all processes' devices and
global batches (tests/parallel/test_multiprocess.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kfacx.parallel import _sharded_state
from kfacx.parallel._owned_pmap import owned_pmap

_P = PartitionSpec

#: The leading parameters of every step function `Placement.stage` stages, in order:
#: per device under ``pmap``; the batch split over the data axis on a mesh. Parameters
#: after them are options shared by all devices.
STEP_INPUTS = ("params", "state", "rng", "batch", "func_state")

#: ``(param_shardings, replicated) -> a pytree prefix of a staged function's outputs``.
OutShardings = Callable[[Any, NamedSharding], Any]


class Placement:
    """How the optimizer stages its step and where its inputs live.

    Raises:
      TypeError: if ``mesh`` is not a `jax.sharding.Mesh`.
      ValueError: for inconsistent options (both ``multi_device`` and ``mesh``,
        ``use_shard_map`` without a mesh, an unknown or ambiguous data axis).
    """

    def __init__(
        self,
        multi_device: bool,
        pmap_axis_name: str,
        mesh: Mesh | None,
        data_axis_name: str | None,
        use_shard_map: bool,
        distributed_inverses: bool,
        compiler_options: Mapping[str, Any] | None = None,
        shard_curvature_state: bool = False,
    ):
        if compiler_options is not None and not isinstance(compiler_options, Mapping):
            raise TypeError(
                "compiler_options must be a dict of XLA options (e.g. "
                f"kfacx.fast_compile_options()), got {type(compiler_options).__name__}."
            )
        if compiler_options and multi_device:
            raise ValueError(
                "compiler_options apply to jax.jit; the multi_device=True (jax.pmap) step "
                "cannot take them. Use mesh= (sharded jax.jit) instead of multi_device."
            )
        self.compiler_options = dict(compiler_options or {})
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
        if mesh is not None and multi_device:
            raise ValueError(
                "Pass either multi_device=True (jax.pmap) or mesh= (sharded jax.jit), not both."
            )
        if shard_curvature_state and mesh is None and not multi_device:
            raise ValueError(
                "shard_curvature_state=True splits the curvature state over devices: pass "
                "mesh= (sharded jit, or use_shard_map=True) or multi_device=True (jax.pmap)."
            )
        self.shard_state = bool(shard_curvature_state)
        if use_shard_map and mesh is None:
            raise ValueError("use_shard_map=True needs a mesh= whose data axis to map over.")
        if mesh is None and data_axis_name is not None:
            raise ValueError("data_axis_name is only used with mesh=.")
        if mesh is not None:
            names = tuple(mesh.axis_names)
            if data_axis_name is None:
                if len(names) != 1:
                    raise ValueError(
                        f"The mesh has axes {names}; pass data_axis_name= to say which one "
                        "the batch is split over."
                    )
                data_axis_name = names[0]
            if data_axis_name not in names:
                raise ValueError(
                    f"data_axis_name={data_axis_name!r} is not an axis of the mesh {names}."
                )
            # The step is partitioned by the compiler (or by shard_map), so the
            # mesh's axes are used as Auto axes: with Explicit axes (the default of
            # `jax.make_mesh`) every op of the user's model would need sharding rules.
            mesh = _auto_mesh(mesh)
        self.mesh = mesh
        self.data_axis_name = data_axis_name
        self.distributed_inverses = distributed_inverses
        if multi_device:
            self.kind, self.axis_name = "pmap", pmap_axis_name
        elif mesh is None:
            self.kind, self.axis_name = "single", None
        elif use_shard_map:
            self.kind, self.axis_name = "shard_map", data_axis_name
        else:
            self.kind, self.axis_name = "mesh", None

    # ---------------------------------------------------------------- sizes

    @property
    def num_shards(self) -> int:
        """Devices the batch is split over in the mesh placements (1 otherwise)."""
        if self.mesh is None:
            return 1
        return int(self.mesh.shape[self.data_axis_name])

    @property
    def state_shards(self) -> int:
        """The devices a sharded curvature state is split over: the data axis of the
        mesh, or every device under ``pmap``."""
        return jax.device_count() if self.kind == "pmap" else self.num_shards

    def check_batch(self, batch: Any) -> None:
        """Raises a ValueError if the mesh's data axis does not divide the batch."""
        n = self.num_shards
        for leaf in jax.tree.leaves(batch):
            size = jax.numpy.shape(leaf)[0] if jax.numpy.ndim(leaf) else None
            if size is None or size % n:
                raise ValueError(
                    f"The batch's leading dimension ({size}) must be divisible by the {n} "
                    f"devices of the mesh axis {self.data_axis_name!r}."
                )

    def local_batch(self, batch: Any) -> Any:
        """A batch with the shapes one step function sees (the device's shard
        under ``shard_map``; the whole batch otherwise)."""
        if self.kind != "shard_map":
            return batch
        self.check_batch(batch)
        n = self.num_shards
        return jax.tree.map(lambda x: x[: jax.numpy.shape(x)[0] // n], batch)

    # ---------------------------------------------------------------- data placement

    def adopt(self, *trees: Any) -> tuple[Any, ...]:
        """``trees`` with every array that lives on a mesh with Explicit axes (the
        default of `jax.make_mesh`, e.g. a batch from
        `jax.make_array_from_process_local_data`) moved onto the same devices and
        spec of that mesh with Auto axes: no copy, and the arrays' types no longer
        ask every operation of the model for sharding rules."""
        return tuple(jax.tree.map(_on_auto_axes, tree) for tree in trees)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, _P())

    def put(self, batch: Any, *replicated: Any) -> tuple[Any, ...]:
        """Moves inputs onto the mesh: the batch split over the data axis, the
        rest replicated (no copy when they already are), but for arrays already
        sharded over the mesh (parameters laid out as in fully-sharded data
        parallelism), which keep their sharding."""
        if self.mesh is None:
            return (batch, *replicated)
        self.check_batch(batch)
        data = NamedSharding(self.mesh, _P(self.data_axis_name))
        rep = self.replicated()
        if self.shard_state:
            return (jax.device_put(batch, data), *(self._place(x) for x in replicated))
        return (jax.device_put(batch, data), *(_replicate(x, rep) for x in replicated))

    def param_shardings(self, params: Any) -> Any:
        """The shardings of ``params`` on the mesh (replicated for leaves that are not
        sharded), or None when no leaf is sharded over the mesh."""
        if self.mesh is None or not any(map(self._sharded, jax.tree.leaves(params))):
            return None
        rep = self.replicated()
        return jax.tree.map(
            lambda x: NamedSharding(self.mesh, x.sharding.spec) if self._sharded(x) else rep,
            params,
        )

    def _sharded(self, x: Any) -> bool:
        return _sharded_on(x, self.mesh)

    def _place(self, tree: Any) -> Any:
        """``tree`` replicated on the mesh, but the buffers of every
        `ShardedEstimatorState` split over the data axis."""
        split = NamedSharding(self.mesh, _P(self.data_axis_name))

        def place(x):
            if _sharded_state.is_sharded(x):
                return _sharded_state.ShardedEstimatorState(
                    tuple(jax.device_put(b, split) for b in x.buffers)
                )
            return _replicate(x, self.replicated())

        return jax.tree.map(place, tree, is_leaf=_sharded_state.is_sharded)

    def _constrained(self, fn: Callable[..., Any], others: bool = True) -> Callable[..., Any]:
        """``fn`` with its outputs laid out as `_place` places inputs (under `jax.jit`);
        with ``others=False`` only the sharded states' buffers are constrained (the
        rest is laid out by ``out_shardings``)."""
        split = NamedSharding(self.mesh, _P(self.data_axis_name))
        rep = self.replicated()

        def constrain(x):
            if _sharded_state.is_sharded(x):
                return _sharded_state.ShardedEstimatorState(
                    tuple(jax.lax.with_sharding_constraint(b, split) for b in x.buffers)
                )
            return jax.lax.with_sharding_constraint(x, rep) if others else x

        @functools.wraps(fn)
        def constrained(*args):
            return jax.tree.map(constrain, fn(*args), is_leaf=_sharded_state.is_sharded)

        return constrained

    # ---------------------------------------------------------------- staging

    def stage_init(
        self, fn: Callable[..., Any], debug: bool, out_shardings: OutShardings | None = None
    ) -> Callable[..., Any]:
        """``fn(params, rng, batch, func_state) -> state``, staged for this placement
        (see `stage` for ``out_shardings``)."""
        if debug:
            return fn
        if self.kind == "pmap":
            return owned_pmap(fn, self.axis_name)
        if self.mesh is None:
            return fn
        if self.shard_state:
            staged = self._jit(self._constrained(fn))
            return self._keeping_param_shardings(
                self._constrained(fn, others=False), staged, out_shardings
            )
        return self._keeping_param_shardings(
            fn, self._jit(fn, out_shardings=self.replicated()), out_shardings
        )

    def stage(
        self,
        fn: Callable[..., Any],
        debug: bool,
        has_aux: bool = False,
        out_shardings: OutShardings | None = None,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """Stages ``fn(params, state, rng, batch, func_state, *options)``.

        The arguments named in `STEP_INPUTS` are per device under ``pmap``
        (the batch is split over the data axis in the mesh placements); the
        options after them are shared. With ``has_aux`` the last output is the
        stats dict, whose ``"aux"`` entry is per device: under ``shard_map`` it
        comes back with a leading device axis, as from pmap.

        On a mesh, outputs are replicated; when parameters come sharded over the
        mesh (`param_shardings`), ``out_shardings(param_shardings, replicated)``
        gives the outputs' shardings instead (a pytree prefix of the outputs: the
        parameters' shardings for the new parameters and anything shaped like
        them), so that nothing parameter-sized is replicated.

        The arguments at ``donate_argnums`` are donated (their buffers may be reused
        for the outputs and deleted), under every placement.

        Raises:
          TypeError: if ``fn``'s leading parameters are not `STEP_INPUTS`.
        """
        names = _parameter_names(fn)
        donate = {"donate_argnums": tuple(donate_argnums)}
        if debug and self.kind in ("single", "pmap"):
            return fn
        if self.kind == "single":
            return self._jit(fn, **donate)
        if self.kind == "pmap":
            in_axes = tuple(0 if name in STEP_INPUTS else None for name in names)
            return owned_pmap(fn, self.axis_name, in_axes, **donate)
        if self.kind == "mesh":
            if debug:
                return fn
            if self.shard_state:
                staged = self._jit(self._constrained(fn), **donate)
                kept = self._constrained(fn, others=False)
                return self._keeping_param_shardings(kept, staged, out_shardings, **donate)
            replicated = self._jit(fn, out_shardings=self.replicated(), **donate)
            return self._keeping_param_shardings(fn, replicated, out_shardings, **donate)
        if self.shard_state:
            return self._stage_sharded_shard_map(fn, debug, has_aux, out_shardings, **donate)
        axis = self.axis_name

        def local(params, state, rng, batch, func_state, *options):
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))  # one sample per device
            out = fn(params, state, rng, batch, func_state, *options)
            if not has_aux or "aux" not in out[-1]:
                return out, None
            stats = dict(out[-1])
            aux = jax.tree.map(lambda x: x[None], stats.pop("aux"))
            return (*out[:-1], stats), aux

        in_specs = tuple(_P(axis) if name == "batch" else _P() for name in names)
        # check_vma=False: the step re-evaluates the traced loss function's jaxpr
        # primitive by primitive, which mixes device-varying and replicated
        # operands without `pvary` (as under pmap). Outputs declared replicated
        # are: everything returned is averaged over the axis first.
        mapped = jax.shard_map(
            local, mesh=self.mesh, in_specs=in_specs, out_specs=(_P(), _P(axis)), check_vma=False
        )

        def staged(*args):
            out, aux = mapped(*args)
            if aux is None:
                return out
            return (*out[:-1], {**out[-1], "aux": aux})

        if debug:
            return staged
        return self._keeping_param_shardings(
            staged, self._jit(staged, **donate), out_shardings, **donate
        )

    def _keeping_param_shardings(
        self,
        fn: Callable[..., Any],
        staged: Callable[..., Any],
        out_shardings: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """``staged`` (``fn`` jit-compiled with replicated outputs) for replicated
        parameters; for parameters sharded over the mesh, ``fn`` jit-compiled with
        ``out_shardings(param_shardings, replicated)``, once per layout."""
        if out_shardings is None:
            return staged
        compiled: dict[Any, Callable[..., Any]] = {}

        def jitted(params):
            shardings = self.param_shardings(params)
            if shardings is None:
                return staged
            key = (jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)))
            if key not in compiled:
                outs = out_shardings(shardings, self.replicated())
                compiled[key] = self._jit(fn, out_shardings=outs, donate_argnums=donate_argnums)
            return compiled[key]

        def call(params, *args):
            return jitted(params)(params, *args)

        # Ahead-of-time lowering, as of a `jax.jit` function (the program of the
        # parameters' layout).
        call.lower = lambda params, *args: jitted(params).lower(params, *args)
        return call

    def _stage_sharded_shard_map(
        self,
        fn: Callable[..., Any],
        debug: bool,
        has_aux: bool,
        out_shardings: Any = None,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """`stage` under ``shard_map`` with ``shard_curvature_state``: the buffers of
        every `ShardedEstimatorState` among the inputs and outputs are split over the
        data axis (each device sees its own row), everything else as in `stage`."""
        names, axis = _parameter_names(fn), self.axis_name
        donate = {"donate_argnums": tuple(donate_argnums)}
        found: list[Any] = []  # the outputs' structure, with the sharded states cut out

        def local(*args):
            rng = jax.random.fold_in(args[2], jax.lax.axis_index(axis))
            out = fn(*args[:2], rng, *args[3:])
            aux = None
            if has_aux and "aux" in out[-1]:
                stats = dict(out[-1])
                aux = jax.tree.map(lambda x: x[None], stats.pop("aux"))
                out = (*out[:-1], stats)
            leaves, treedef = jax.tree.flatten(out, is_leaf=_sharded_state.is_sharded)
            sharded = [x if _sharded_state.is_sharded(x) else None for x in leaves]
            rest = [None if _sharded_state.is_sharded(x) else x for x in leaves]
            found[:] = [treedef]
            return rest, aux, sharded

        def staged(*args):
            in_specs = tuple(
                _P(axis) if name == "batch" else _sharded_state.sharded_state_specs(a, axis)
                for name, a in zip(names, args, strict=False)
            )
            mapped = jax.shard_map(
                local,
                mesh=self.mesh,
                in_specs=in_specs,
                out_specs=(_P(), _P(axis), _P(axis)),
                check_vma=False,
            )
            rest, aux, sharded = mapped(*args)
            leaves = [s if s is not None else r for r, s in zip(rest, sharded, strict=True)]
            out = jax.tree.unflatten(found[0], leaves)
            if aux is None:
                return out
            return (*out[:-1], {**out[-1], "aux": aux})

        if debug:
            return staged
        return self._keeping_param_shardings(
            staged, self._jit(staged, **donate), out_shardings, **donate
        )

    def _jit(self, fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        if self.compiler_options:
            kwargs["compiler_options"] = self.compiler_options
        return jax.jit(fn, **kwargs)


def _auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with Auto axes (same devices and names)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _on_auto_axes(x: Any) -> Any:
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
    if isinstance(x, jax.core.Tracer) or not isinstance(sharding, NamedSharding):
        return x
    if AxisType.Explicit not in tuple(sharding.mesh.axis_types):
        return x
    return jax.device_put(x, NamedSharding(_auto_mesh(sharding.mesh), sharding.spec))


def _sharded_on(x: Any, mesh: Mesh) -> bool:
    """Whether ``x`` is an array sharded (not replicated) over ``mesh``'s devices."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    sharding = x.sharding
    return (
        isinstance(sharding, NamedSharding)
        and not sharding.is_fully_replicated
        and sharding.mesh.devices.shape == mesh.devices.shape
        and sharding.mesh.axis_names == mesh.axis_names
        and (sharding.mesh.devices == mesh.devices).all()
    )


def _replicate(tree: Any, sharding: NamedSharding) -> Any:
    """``tree`` with its leaves replicated as ``sharding``, but for leaves already
    sharded over its mesh, which are left as they are.

    With several processes, a leaf that is not yet a global array (a NumPy array,
    a random key, an array on one device) is this process's copy of a value that
    every process holds (parameters, optimizer state, rng): it is copied onto this
    process's devices of the mesh, with no check or transfer between processes
    (there `jax.device_put` refuses random keys and arrays committed to a device,
    and compares other values across the processes, a blocking collective)."""
    leaves = jax.tree.leaves(tree)
    if jax.process_count() == 1 and not any(_sharded_on(x, sharding.mesh) for x in leaves):
        return jax.device_put(tree, sharding)

    def put(x):
        if _sharded_on(x, sharding.mesh):
            return _on_auto_axes(x)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # a global array: moved by JAX
        value = x if isinstance(x, jax.Array) else jax.numpy.asarray(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda _: value)

    return jax.tree.map(put, tree)


def _parameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``fn``'s parameters, checked to start with `STEP_INPUTS`."""
    names = tuple(inspect.signature(fn).parameters)
    if names[: len(STEP_INPUTS)] != STEP_INPUTS:
        raise TypeError(
            f"A staged step function takes {STEP_INPUTS} first, then options; "
            f"{getattr(fn, '__name__', fn)} takes {names}."
        )
    return names
