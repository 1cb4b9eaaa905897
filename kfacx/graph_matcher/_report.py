"""`RegistrationReport`: every parameter, the tag it got and the block that serves it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class RegistrationEntry:
    """One parameter's registration.

    Attributes:
      path: the parameter's pytree path (e.g. ``"mlp/~/linear_0/w"``).
      tag: the layer tag's name (``"generic_tag"`` for unmatched parameters).
      source: ``"manual"`` (a register_* call in the model), the name of the
        `GraphPattern` that matched, or ``"unmatched"``.
      layer: index of the layer (tag) among all layers, in evaluation order.
      block: name of the curvature block class serving it ("" until known).
      uses: how many times the layer is applied (more than 1 for tied weights,
        and the scan length for a layer applied at every iteration of a `lax.scan`).
      stack_size: for a stacked layer (a `lax.scan` over its parameters, e.g.
        `hk.layer_stack`), the number of stacked layers; None otherwise.
      in_branch: whether every use of the layer sits in a `lax.cond` /
        `lax.switch` branch: its statistics are updated only by the batches
        that run it.
    """

    path: str
    tag: str
    layer: int
    source: str
    block: str = ""
    uses: int = 1
    stack_size: int | None = None
    in_branch: bool = False


@dataclasses.dataclass(frozen=True)
class RegistrationReport:
    """What automatic registration found, parameter by parameter.

    Attributes:
      entries: one `RegistrationEntry` per parameter leaf, in pytree order.
      unmatched: paths of the parameters no pattern (and no manual tag) matched.
      notes: anything else the user should know (e.g. parameters used by
        several layers, parameters inside loops that are not looked into).

    In the text, the layer column shows ``(xN)`` for a layer applied ``N``
    times, ``(N stacked)`` for a stacked layer and ``(in branch)`` for a layer
    used only inside cond branches.

    ``str(report)`` is a readable table.
    """

    entries: tuple[RegistrationEntry, ...]
    unmatched: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def with_blocks(self, block_name: Callable[[RegistrationEntry], str]) -> RegistrationReport:
        """A copy with each entry's ``block`` set by ``block_name(entry)``."""
        entries = tuple(dataclasses.replace(e, block=block_name(e)) for e in self.entries)
        return dataclasses.replace(self, entries=entries)

    @property
    def matched_fraction(self) -> float:
        """Fraction of parameter leaves that got a non-fallback tag."""
        if not self.entries:
            return 1.0
        return 1.0 - len(self.unmatched) / len(self.entries)

    def __str__(self) -> str:
        header = ("parameter", "layer", "tag", "found by", "block")
        rows = [
            (
                e.path,
                f"{e.layer}"
                + (f" (x{e.uses})" if e.uses > 1 else "")
                + (f" ({e.stack_size} stacked)" if e.stack_size else "")
                + (" (in branch)" if e.in_branch else ""),
                e.tag,
                e.source,
                e.block or "-",
            )
            for e in self.entries
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(row):
            return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

        out = [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]
        matched = len(self.entries) - len(self.unmatched)
        out.append(f"{matched}/{len(self.entries)} parameters matched to a layer tag.")
        if self.unmatched:
            out.append("unmatched (fallback block): " + ", ".join(self.unmatched))
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)
