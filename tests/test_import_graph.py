"""kfacx's modules import one another without circles, and only downwards between wings,
read from the source.

Every ``import`` and ``from ... import`` statement of every module counts, those under
``if TYPE_CHECKING:`` and inside functions included: a circle there is a circle in the
design even where Python would not trip over it. ``from package import name`` is an
edge to the submodule ``package.name`` when there is one, else to the package.

The wings are the entries of ``kfacx/``, from the bottom up (`WINGS`); a module may
import from its own wing and from the wings below it. The package's ``__init__`` (the
public names) sits on top of them all.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kfacx"

#: kfacx's wings from the bottom up (docs/overview.md draws the same picture).
WINGS = (
    "tags",
    "_helpers",
    "linalg",
    "parallel",
    "losses",
    "blocks",
    "graph_matcher",
    "tracer",
    "estimator",
    "transform",
    "optimizer",
    "flax",
    "kfac_jax",
)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                found = owner(target) if target.split(".")[0] == "kfacx" else None
                if found is not None and found != name:
                    edges[name].add(found)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_import_graph_reads_every_module():
    edges = _import_graph()
    assert "kfacx.graph_matcher._match" in edges
    assert "kfacx.graph_matcher._graph" in edges["kfacx.graph_matcher._match"]
    assert "kfacx._helpers._jaxpr" in edges["kfacx.graph_matcher._auto_register"]


def test_no_import_circles():
    assert _circles(_import_graph()) == []


def test_a_circle_is_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]


def _wing(module: str) -> str | None:
    """The wing of a module (``None`` for the package ``kfacx`` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _upward_imports(edges: dict[str, set[str]], wings=WINGS) -> list[tuple[str, str]]:
    """The imports from a wing of a module of a wing above it (or of ``kfacx`` itself)."""
    rank = {wing: i for i, wing in enumerate(wings)}
    found = []
    for source, targets in sorted(edges.items()):
        if _wing(source) is None:
            continue
        for target in sorted(targets):
            target_wing = _wing(target)
            if target_wing is None or rank[target_wing] > rank[_wing(source)]:
                found.append((source, target))
    return found


def test_every_entry_of_the_package_is_a_wing():
    entries = {
        path.stem
        for path in ROOT.iterdir()
        if path.name != "__init__.py"
        and not path.name.startswith(".")
        and path.name != "__pycache__"
        and (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert entries == set(WINGS), "place a new module of kfacx/ in a wing (WINGS)"
    assert {_wing(name) for name in _import_graph()} - {None} == set(WINGS)


def test_imports_only_go_down_between_wings():
    assert _upward_imports(_import_graph()) == []


def test_an_upward_import_is_found():
    edges = {
        "kfacx": {"kfacx.b.x"},
        "kfacx.a.x": {"kfacx.a.y", "kfacx.b.x"},
        "kfacx.a.y": set(),
        "kfacx.b.x": {"kfacx.a.x", "kfacx"},
    }
    assert _upward_imports(edges, wings=("a", "b")) == [
        ("kfacx.a.x", "kfacx.b.x"),
        ("kfacx.b.x", "kfacx"),
    ]
    assert _upward_imports(edges, wings=("b", "a")) == [
        ("kfacx.b.x", "kfacx"),
        ("kfacx.b.x", "kfacx.a.x"),
    ]


#: The public modules' names in the last release (0.1.0.dev0, before the wings), read
#: from its source: they keep their import paths.
LAST_RELEASE = {
    "kfacx.optimizer": ("Optimizer", "OptimizerState", "CurvatureConfig", "BatchConfig"),
    "kfacx.transform": (
        "ScaleByKfacState",
        "estimator_state",
        "precondition",
        "scale_by_kfac",
        "flag_non_finite_stats",
        "AccumulateCurvatureStatsState",
        "accumulate_curvature_stats",
    ),
    "kfacx.estimator": (
        "DEFAULT_LAYER_TAG_TO_BLOCK_CTOR",
        "ESTIMATION_MODES",
        "BlockDiagonalCurvature",
        "CurvatureStats",
        "EstimatorState",
        "weighted_mean_stats",
    ),
    "kfacx.tracer": (
        "TracedFunction",
        "shape_key",
        "trace",
        "trace_cached",
        "layer_tags_vjp",
        "value_and_grad_and_layer_tags_vjp",
        "loss_tags_jvp",
        "loss_tags_vjp",
        "loss_tags_linearize",
    ),
    "kfacx.losses": (
        "LossFunction",
        "SoftmaxCrossEntropyLoss",
        "SigmoidCrossEntropyLoss",
        "NormalPredictiveLoss",
        "CTCLoss",
        "register_loss_class",
        "loss_from_tag",
    ),
    "kfacx.flax": ("TrainState", "NNXLoss", "nnx_value_grads_and_curvature_stats"),
}


def test_the_last_releases_import_paths_still_work():
    missing = [
        f"{module}.{name}"
        for module, names in LAST_RELEASE.items()
        for name in names
        if not hasattr(importlib.import_module(module), name)
    ]
    assert missing == []
