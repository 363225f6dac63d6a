"""Pictures of plans: the topology with each tree of a plan in its own colour (matplotlib).

``draw_plan(plan, path="trees.png")`` writes a PNG (Agg backend, no display needed);
``draw_plan(plan, ax=ax)`` draws into an existing axes (notebooks).
"""

from __future__ import annotations

from typing import Any

import networkx as nx

__all__ = ["draw_plan", "layout"]

# A cube seen slightly from above: front face 0-3, back face 4-7, GPU i above i + 4. This is the
# DGX-1 "hybrid cube-mesh" as NVIDIA draws it (the quads 0-3 and 4-7 fully linked inside, i <-> i+4).
# The back face is shifted right past the front face (a steep oblique view), so that no GPU sits
# on another pair's link and the diagonals of both quads stay readable.
_CUBE = {
    0: (0.0, 1.0), 1: (1.0, 1.0), 2: (0.0, 0.0), 3: (1.0, 0.0),
    4: (1.4, 1.55), 5: (2.4, 1.55), 6: (1.4, 0.55), 7: (2.4, 0.55),
}

_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
            "tab:pink", "tab:olive", "tab:cyan", "gold", "navy", "lime"]


def layout(topology: Any) -> dict[int, tuple[float, float]]:
    """Node positions: the fixed cube for DGX-1 presets and their subsets, circular otherwise."""
    name = str(getattr(topology, "name", ""))
    devs = list(topology.devices)
    if name.startswith("dgx1") and all(d in _CUBE for d in devs):
        return {d: _CUBE[d] for d in devs}
    pos = nx.circular_layout(devs)
    return {d: (float(p[0]), float(p[1])) for d, p in pos.items()}


def _ring_rate(plan: Any) -> float | None:
    try:
        from .simulate import algbw, rings

        return algbw(rings(plan.topology), plan.collective)
    except Exception:  # the picture must not fail for want of a baseline
        return None


def draw_plan(plan: Any, ax: Any = None, path: str | None = None, *, title: str | None = None,
              max_trees: int = 12) -> Any:
    """Draw ``plan``'s topology and trees; return the matplotlib axes.

    Physical links are grey lines (thicker for parallel links, labelled with their GB/s); each tree
    is a set of arrows in its own colour, curved by a different amount per tree so that trees that
    share a link stay visible; the legend gives each tree's root and weight (GB/s). The title
    compares the plan's rate with its bound and with NCCL's rings (algorithm bandwidth, from
    :mod:`jax_blink.simulate`).

    Args:
        plan: a :class:`jax_blink.treegen.Plan`.
        ax: axes to draw into (a new figure if None).
        path: if given, save the figure there (PNG etc.; uses the Agg backend when no figure
            exists yet, so it works without a display) and close it if we made it.
        title: override the title.
        max_trees: draw at most this many trees (the heaviest); the legend says how many are left.
    """
    import sys

    import matplotlib

    made = ax is None
    if made and path is not None and "matplotlib.pyplot" not in sys.modules and _no_display():
        matplotlib.use("Agg")  # saving to a file without a display
    import matplotlib.pyplot as plt

    topo = plan.topology
    if made:
        fig, ax = plt.subplots(figsize=(6.4, 5.6))
    else:
        fig = ax.figure
    pos = layout(topo)
    s = topo.simple_graph()

    # Physical links, one line per unordered pair.
    und: dict[tuple[int, int], tuple[int, float, str]] = {}
    for u, v in s.edges:
        a, b = min(u, v), max(u, v)
        if (a, b) in und:
            continue
        count = max(topo.graph.number_of_edges(u, v), topo.graph.number_of_edges(v, u))
        kinds = s[u][v].get("kinds", ("?",))
        und[(a, b)] = (count, float(topo.capacity(u, v)), "/".join(kinds))
    for (a, b), (count, cap, kind) in und.items():
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.plot([x0, x1], [y0, y1], color="0.82", lw=1.5 + 2.5 * (count - 1), zorder=1,
                ls="--" if kind in ("pcie", "host") else "-")
        if topo.n <= 8:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2, f"{cap:g}", fontsize=6, color="0.45",
                    ha="center", va="center", zorder=2,
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.7))

    # Trees.
    trees = sorted(enumerate(plan.trees), key=lambda t: -t[1][1])[:max_trees]
    handles = []
    from matplotlib.lines import Line2D

    for k, (i, (tree, w)) in enumerate(trees):
        colour = _COLOURS[k % len(_COLOURS)]
        rad = 0.08 + 0.07 * (k // 2)
        rad = rad if k % 2 == 0 else -rad
        g = nx.DiGraph(tree)
        # arc3 bends relative to the direction of travel: flip it for edges drawn "backwards" so
        # that each tree keeps its own side of a link whichever way its edges point.
        for sign, edges in ((1, [(u, v) for u, v in g.edges if u < v]),
                            (-1, [(u, v) for u, v in g.edges if u > v])):
            if edges:
                nx.draw_networkx_edges(g, pos, edgelist=edges, ax=ax, edge_color=colour, width=1.8,
                                       arrows=True, arrowstyle="-|>", arrowsize=12,
                                       connectionstyle=f"arc3,rad={sign * rad}", node_size=520,
                                       alpha=0.9)
        roots = [v for v in g.nodes if g.in_degree(v) == 0]
        r = roots[0] if roots else "?"
        handles.append(Line2D([0], [0], color=colour, lw=2, label=f"tree {i}: root {r}, {w:.4g} GB/s"))
    left = len(plan.trees) - len(trees)
    if left > 0:
        handles.append(Line2D([0], [0], color="white", label=f"(+{left} more trees, lighter or equal, not drawn)"))

    roots = {v for tree, _ in plan.trees for v in tree.nodes if tree.in_degree(v) == 0}
    nx.draw_networkx_nodes(s, pos, ax=ax, node_size=520,
                           node_color=["#ffd27f" if d in roots else "#dde8f5" for d in topo.devices],
                           edgecolors="0.25")
    nx.draw_networkx_labels(s, pos, ax=ax, font_size=10)

    if title is None:
        ring = _ring_rate(plan)
        ring_s = f"; NCCL rings {ring:.4g} GB/s" if ring is not None else ""
        rate, bound = float(plan.rate), float(getattr(plan, "bound", float("nan")))
        title = (f"{topo.name} {plan.collective}: {len(plan.trees)} tree(s)\n"
                 f"rate {rate:.4g} GB/s (bound {bound:.4g}){ring_s}")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_axis_off()
    ax.margins(0.12)
    if path is not None:
        fig.savefig(path, dpi=120, bbox_inches="tight")
        if made:
            plt.close(fig)
    return ax


def _no_display() -> bool:
    import os
    import sys

    if sys.platform.startswith("linux"):
        return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return False
