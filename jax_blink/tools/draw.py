"""Pictures of topologies and plans (matplotlib).

``draw_plan(plan, "trees.png")`` writes one small panel per tree of the plan, all on the same fixed
layout of the machine, after a first panel with the links and their GB/s. ``draw_topology(topology,
"links.png")`` draws the links alone. Without a path both draw into a new pyplot figure (notebooks).

Layouts: the DGX-1 presets and their subsets as NVIDIA draws the hybrid cube-mesh (two quads of four
GPUs side by side, each a square with its diagonals, GPU i beside GPU i + 4); NVSwitch and CPU host
meshes (every pair linked alike) on a circle; other topologies by Kamada-Kawai (a ring comes out as
a circle, a grid as a grid). A link that would pass through another device is drawn as an arc.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

__all__ = ["check_path", "draw_plan", "draw_topology", "layout"]

# DGX-1 hybrid cube-mesh: quad 0-3 on the left, quad 4-7 on the right, mirrored so that the links
# 1-5 and 3-7 are short; 0-4 and 2-6 become arcs over and under the picture (an unfolded cube).
_GAP = 1.5
_CUBE = {
    0: (0.0, 1.0), 1: (1.0, 1.0), 2: (0.0, 0.0), 3: (1.0, 0.0),
    5: (1.0 + _GAP, 1.0), 4: (2.0 + _GAP, 1.0), 7: (1.0 + _GAP, 0.0), 6: (2.0 + _GAP, 0.0),
}

TREE_COLOUR = "tab:blue"
ROOT_COLOUR = "#ff9f1c"
NODE_COLOUR = "#e8eef7"
LINK_COLOUR = "0.78"
LINK_COLOUR_MESH = "0.88"

_MAX_FIG_W, _MAX_FIG_H = 17.0, 22.0  # inches: about a screen's or a page's worth
_MIN_FIG_W = 6.5                      # inches: room for the figure's title
_MIN_PANEL_W = 0.9                    # inches: below this the panels shrink no further, the figure grows
_PANEL_AREA = 5.0                     # square inches per panel (drawing area, title excluded)
_GAP_W = 0.15                         # inches between panels side by side
_HEAD_H = 0.6                         # inches for the figure's two-line title
_FOOT_H = 0.08                        # inches below the last row


# ---------------------------------------------------------------------- paths
def check_path(path: str | os.PathLike[str]) -> Path:
    """Check that a picture can be written to ``path`` before any work is done; return it as a Path.

    Raises:
        TypeError: ``path`` is not a string or path.
        FileNotFoundError: its folder does not exist.
        ValueError: no file name suffix, or one that matplotlib cannot write.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"picture path must be a file name (str or os.PathLike), got {type(path).__name__}: "
                        f"{path!r}")
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        blocker = next((f for f in (folder, *folder.parents) if f.exists() and not f.is_dir()), None)
        why = (f"{str(blocker)!r} is a file, not a folder; choose another path" if blocker is not None
               else f"folder {str(folder)!r} does not exist; create it first or choose another path")
        raise FileNotFoundError(f"cannot write the picture {str(p)!r}: {why}")
    fmt = p.suffix.lstrip(".").lower()
    formats = _formats()
    if fmt not in formats:
        what = f"unknown picture format {p.suffix!r}" if fmt else "no file name suffix"
        raise ValueError(f"cannot write the picture {str(p)!r}: {what}; end the name in one of "
                         + ", ".join("." + f for f in sorted(formats)))
    return p


def _formats() -> set[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


# ---------------------------------------------------------------------- layout and geometry
def layout(topology: Any) -> dict[int, tuple[float, float]]:
    """Device positions: the DGX-1 cube-mesh for DGX-1 presets and their subsets, a circle for
    uniform meshes (NVSwitch, CPU host devices), otherwise Kamada-Kawai or a circle, whichever
    crosses fewer links."""
    devs = list(topology.devices)
    name = str(getattr(topology, "name", ""))
    if name.startswith("dgx1") and all(d in _CUBE for d in devs):
        return {d: _CUBE[d] for d in devs}
    if len(devs) <= 3 or _is_full_mesh(topology):
        return _circle(devs)
    und = nx.Graph(topology.simple_graph().to_undirected())
    circle = _circle(devs)
    if not nx.is_connected(und):
        return circle
    candidates = []
    for start in ("spectral", "circle"):  # Kamada-Kawai finds a local optimum: try two starts
        try:
            init = nx.spectral_layout(und) if start == "spectral" else nx.circular_layout(und)
            found = nx.kamada_kawai_layout(und, pos=init)  # needs scipy (a dependency of jax)
        except (ImportError, nx.NetworkXException, ValueError):
            found = nx.spring_layout(und, seed=0)
        candidates.append(_upright({d: (float(found[d][0]), float(found[d][1])) for d in devs}, und.edges))
    candidates.append(circle)
    # Kamada-Kawai shows the structure (a ring as a ring, a grid as a grid); the circle in
    # device order stays where it crosses fewer links.
    return min(candidates, key=lambda pos: _crossings(pos, und.edges))


def _upright(pos: dict[int, tuple[float, float]], edges: Any) -> dict[int, tuple[float, float]]:
    """``pos`` turned so that the links lie as close to horizontal or vertical as they can (a grid
    stands square), wider than tall, centred and scaled into the unit circle."""
    import cmath

    acc = sum((cmath.exp(4j * cmath.phase(complex(*pos[v]) - complex(*pos[u]))) for u, v in edges), 0j)
    turn = cmath.exp(-1j * cmath.phase(acc) / 4) if abs(acc) > 1e-9 else 1
    z = {d: complex(*p) * turn for d, p in pos.items()}
    xs, ys = [c.real for c in z.values()], [c.imag for c in z.values()]
    if max(ys) - min(ys) > 1.05 * (max(xs) - min(xs)):
        z = {d: c * -1j for d, c in z.items()}
    mid = sum(z.values()) / len(z)
    first = z[next(iter(z))] - mid  # the first device towards the top left, as one reads
    flip = complex(-1 if first.real > 1e-6 else 1, 0)
    z = {d: complex((c - mid).real * flip.real, (c - mid).imag * (-1 if first.imag < -1e-6 else 1))
         for d, c in z.items()}
    mid = 0j
    size = max(abs(c) for c in z.values()) or 1.0
    return {d: (round(((c - mid) / size).real, 9), round(((c - mid) / size).imag, 9)) for d, c in z.items()}


def _crossings(pos: dict[int, tuple[float, float]], edges: Any) -> int:
    """How many pairs of straight links cross (links that share a device never count)."""
    def side(a, b, c) -> float:
        return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

    segs = [(u, v, pos[u], pos[v]) for u, v in edges]
    count = 0
    for i, (u1, v1, a, b) in enumerate(segs):
        for u2, v2, c, d in segs[i + 1:]:
            if {u1, v1} & {u2, v2}:
                continue
            if side(a, b, c) * side(a, b, d) < 0 and side(c, d, a) * side(c, d, b) < 0:
                count += 1
    return count


def _circle(devs: list[int]) -> dict[int, tuple[float, float]]:
    """Devices clockwise from the top, in mesh-axis order."""
    n = len(devs)
    if n == 1:
        return {devs[0]: (0.0, 0.0)}
    if n == 2:
        return {devs[0]: (-1.0, 0.0), devs[1]: (1.0, 0.0)}
    return {d: (math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n)) for i, d in enumerate(devs)}


def _is_full_mesh(topology: Any) -> bool:
    s = topology.simple_graph()
    n = topology.n
    return n >= 2 and s.number_of_edges() == n * (n - 1)


@dataclass
class _Geometry:
    """Where everything goes, in layout units: device centres, their radius, and for each linked
    pair ``(a, b)`` with ``a < b`` the control point of the quadratic Bezier curve it is drawn on."""

    pos: dict[int, tuple[float, float]]
    radius: float
    control: dict[tuple[int, int], tuple[float, float]]
    xlim: tuple[float, float]
    ylim: tuple[float, float]


def _bezier(p0, c, p2, t: float) -> tuple[float, float]:
    a, b, d = (1 - t) ** 2, 2 * (1 - t) * t, t * t
    return (a * p0[0] + b * c[0] + d * p2[0], a * p0[1] + b * c[1] + d * p2[1])


def _geometry(topology: Any) -> _Geometry:
    key = (topology, topology.name)  # equal topologies may have different names, hence layouts
    if key not in _GEOMETRIES:
        if len(_GEOMETRIES) > 32:
            _GEOMETRIES.clear()
        _GEOMETRIES[key] = _make_geometry(topology)
    return _GEOMETRIES[key]


_GEOMETRIES: dict[tuple[Any, str], _Geometry] = {}


def _make_geometry(topology: Any) -> _Geometry:
    pos = layout(topology)
    devs = list(topology.devices)
    pts = [pos[d] for d in devs]
    dists = [math.dist(p, q) for i, p in enumerate(pts) for q in pts[i + 1:]]
    spacing = min(dists) if dists else 1.0
    # Devices on a circle have only their two neighbours that close: they can be larger.
    on_circle = len(devs) > 2 and all(abs(math.hypot(*p) - 1) < 1e-9 for p in pts)
    radius = (0.27 if on_circle else 0.2) * spacing if len(devs) > 1 else 0.3
    if len(devs) > 1:
        # Stay small beside the whole picture too (a tight pair in a wide layout).
        span = max(max(p[0] for p in pts) - min(p[0] for p in pts), max(p[1] for p in pts) - min(p[1] for p in pts))
        radius = min(radius, 0.09 * span)
    # Bend arcs away from the middle of the whole machine (a DGX-1 subset keeps the cube's arcs).
    frame = list(_CUBE.values()) if all(pos[d] == _CUBE.get(d) for d in devs) else pts
    cx = sum(p[0] for p in frame) / len(frame)
    cy = sum(p[1] for p in frame) / len(frame) + 1e-6  # a row of devices: arcs go over it

    control: dict[tuple[int, int], tuple[float, float]] = {}
    s = topology.simple_graph()
    for u, v in s.edges:
        a, b = min(u, v), max(u, v)
        if (a, b) not in control:
            control[(a, b)] = _clear_curve(pos[a], pos[b], [pos[d] for d in devs if d not in (a, b)],
                                           1.6 * radius, (cx, cy))

    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    for (a, b), c in control.items():
        for t in (0.25, 0.5, 0.75):
            x, y = _bezier(pos[a], c, pos[b], t)
            xs.append(x)
            ys.append(y)
    m = 1.35 * radius if len(devs) > 1 else 3 * radius  # a lone device stays device-sized
    return _Geometry(pos, radius, control, (min(xs) - m, max(xs) + m), (min(ys) - m, max(ys) + m))


def _clear_curve(p0, p2, others, clearance: float, centre) -> tuple[float, float]:
    """Control point of the flattest curve from ``p0`` to ``p2`` that keeps ``clearance`` from every
    other device: straight if it can, else bent outward (away from ``centre``) or inward; where
    none is clear, the one that passes farthest from them."""
    mx, my = (p0[0] + p2[0]) / 2, (p0[1] + p2[1]) / 2
    dx, dy = p2[0] - p0[0], p2[1] - p0[1]
    nx_, ny_ = dy, -dx  # matplotlib's arc3 bends toward this side for rad > 0
    out = 1.0 if nx_ * (mx - centre[0]) + ny_ * (my - centre[1]) >= 0 else -1.0
    best, best_gap = (mx, my), -1.0
    for rad in (0.0, 0.12, 0.2, 0.28, 0.36, 0.45, 0.55, 0.7, 0.85):
        for sign in ((out, -out) if rad else (1.0,)):
            c = (mx + sign * rad * nx_, my + sign * rad * ny_)
            samples = [_bezier(p0, c, p2, i / 32) for i in range(1, 32)]
            gap = min((math.dist(q, o) for q in samples for o in others), default=math.inf)
            if gap >= clearance:
                return c
            if gap > best_gap + 1e-9:
                best, best_gap = c, gap
    return best


def _trimmed_path(geom: _Geometry, u: int, v: int):
    """The curve from ``u`` to ``v`` cut where it leaves ``u``'s circle and enters ``v``'s."""
    from matplotlib.path import Path as MplPath

    p0, p2 = geom.pos[u], geom.pos[v]
    c = geom.control.get((min(u, v), max(u, v)), ((p0[0] + p2[0]) / 2, (p0[1] + p2[1]) / 2))
    r = geom.radius * 1.08

    def cross(centre, inside_at_0: bool) -> float:
        lo, hi = 0.0, 1.0  # bisection on the distance to centre (monotone near the ends)
        for _ in range(40):
            mid = (lo + hi) / 2
            inside = math.dist(_bezier(p0, c, p2, mid), centre) < r
            if inside == inside_at_0:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    t0 = cross(p0, True)
    t1 = cross(p2, False)
    # The piece of a quadratic Bezier between t0 and t1 is one with these three points (blossom).
    q0 = _bezier(p0, c, p2, t0)
    q2 = _bezier(p0, c, p2, t1)
    w0, w1, w2 = (1 - t0) * (1 - t1), (1 - t0) * t1 + t0 * (1 - t1), t0 * t1
    q1 = (w0 * p0[0] + w1 * c[0] + w2 * p2[0], w0 * p0[1] + w1 * c[1] + w2 * p2[1])
    return MplPath([q0, q1, q2], [MplPath.MOVETO, MplPath.CURVE3, MplPath.CURVE3])


# ---------------------------------------------------------------------- drawing one panel
def _points_per_unit(ax: Any, geom: _Geometry) -> float:
    bbox = ax.get_window_extent()
    dpi = _root(ax.figure).dpi
    w_pt, h_pt = bbox.width / dpi * 72, bbox.height / dpi * 72
    return min(w_pt / (geom.xlim[1] - geom.xlim[0]), h_pt / (geom.ylim[1] - geom.ylim[0]))


def _pair_links(topology: Any) -> dict[tuple[int, int], tuple[int, float, float, str]]:
    """``(a, b)`` with ``a < b`` -> (parallel links, GB/s a->b, GB/s b->a, kinds)."""
    s = topology.simple_graph()
    g = topology.graph
    out: dict[tuple[int, int], tuple[int, float, float, str]] = {}
    for u, v in s.edges:
        a, b = min(u, v), max(u, v)
        if (a, b) in out:
            continue
        count = max(g.number_of_edges(a, b), g.number_of_edges(b, a))
        kinds = set(s[u][v].get("kinds", ())) | (set(s[v][u].get("kinds", ())) if s.has_edge(v, u) else set())
        out[(a, b)] = (count, topology.capacity(a, b), topology.capacity(b, a), "/".join(sorted(kinds)))
    return out


def _draw_base(ax: Any, topology: Any, geom: _Geometry, scale: float, roots: set[int],
               labels: bool) -> None:
    """Links in grey (thicker for parallel links, dashed for PCIe/host), then the devices."""
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Circle

    r_pt = geom.radius * scale
    lw1 = min(max(0.09 * r_pt, 0.5), 1.8)
    full = _is_full_mesh(topology) and topology.n > 4
    colour = LINK_COLOUR_MESH if full else LINK_COLOUR  # many links: lighter, or they hide the tree
    if full:
        lw1 *= 0.7
    segs, widths, styles = [], [], []
    placed: list[tuple[float, float, float, float]] = []
    for (a, b), (count, cab, cba, kinds) in _pair_links(topology).items():
        c = geom.control[(a, b)]
        p0, p2 = geom.pos[a], geom.pos[b]
        straight = math.dist(c, ((p0[0] + p2[0]) / 2, (p0[1] + p2[1]) / 2)) < 1e-9
        segs.append([p0, p2] if straight else [_bezier(p0, c, p2, i / 32) for i in range(33)])
        widths.append(lw1 * min(count, 4))
        styles.append((0, (3, 2)) if kinds in ("pcie", "host", "host/pcie") else "solid")
        if labels:
            txt = f"{cab:g}" if cab == cba else f"{cab:g}/{cba:g}"
            each = {d["capacity"] for e in ((a, b), (b, a)) for d in (topology.graph.get_edge_data(*e) or {}).values()}
            if count > 1 and len(each) == 1:  # parallel links of one speed: say how many
                txt = f"{count}\u00d7{each.pop():g}"
            fs = min(max(0.65 * r_pt, 4), 9)
            half = (0.32 * fs * len(txt) / scale, 0.6 * fs / scale)  # the label's half size, layout units
            x, y = _label_spot(geom, p0, c, p2, half, placed)
            placed.append((x, y, *half))
            ax.text(x, y, txt, fontsize=fs, color="0.35", ha="center", va="center", gid="link-label",
                    zorder=2, bbox=dict(boxstyle="round,pad=0.12", fc="white", ec="none", alpha=0.85))
    if segs:
        ax.add_collection(LineCollection(segs, colors=colour, linewidths=widths, linestyles=styles,
                                         capstyle="round", zorder=1, gid="links"), autolim=False)
    fs = min(max(0.85 * r_pt, 3.5), 11)
    for d in topology.devices:
        root = d in roots
        ax.add_artist(Circle(geom.pos[d], geom.radius, fc=ROOT_COLOUR if root else NODE_COLOUR,
                             ec="0.15" if root else "0.35", lw=lw1 * (1.6 if root else 1.0), zorder=4,
                             gid="root" if root else "device", label=str(d)))
        ax.text(*geom.pos[d], str(d), fontsize=fs, ha="center", va="center", zorder=5, gid="device-label",
                fontweight="bold" if root else "normal")


def _label_spot(geom: _Geometry, p0, c, p2, half, placed) -> tuple[float, float]:
    """A point on the link for its label: the middle, or off it where the middle is taken by
    another label (two diagonals cross there) or a device."""
    def free(q) -> bool:
        clear_of_labels = all(abs(q[0] - x) > half[0] + hx or abs(q[1] - y) > half[1] + hy
                              for x, y, hx, hy in placed)
        clear_of_devices = all(abs(q[0] - d[0]) > half[0] + geom.radius or abs(q[1] - d[1]) > half[1] + geom.radius
                               for d in geom.pos.values())
        return clear_of_labels and clear_of_devices

    spots = [_bezier(p0, c, p2, t) for t in (0.5, 0.38, 0.62, 0.3, 0.7, 0.24, 0.76)]
    return next((q for q in spots if free(q)), spots[0])


def _finish_axes(ax: Any, geom: _Geometry) -> None:
    ax.set_xlim(*geom.xlim)
    ax.set_ylim(*geom.ylim)
    ax.set_aspect("equal", adjustable="box")
    ax.set_axis_off()


def _draw_tree(ax: Any, plan: Any, index: int, geom: _Geometry, scale: float) -> None:
    from matplotlib.patches import FancyArrowPatch

    tree, w = plan.trees[index]
    root = plan.roots[index] if getattr(plan, "roots", None) else next(
        (v for v in tree.nodes if tree.in_degree(v) == 0), None)
    _draw_base(ax, plan.topology, geom, scale, {root}, labels=False)
    r_pt = geom.radius * scale
    lw = min(max(0.13 * r_pt, 0.7), 2.2)
    head = min(max(0.9 * r_pt, 4.0), 13.0)
    toward_root = plan.collective in ("reduce", "allreduce")  # data flows against the tree's edges
    for u, v in tree.edges:
        src, dst = (v, u) if toward_root else (u, v)
        ax.add_artist(FancyArrowPatch(path=_trimmed_path(geom, src, dst), arrowstyle="-|>",
                                      mutation_scale=head, color=TREE_COLOUR, lw=lw, zorder=3,
                                      gid="tree-edge", label=f"{src}->{dst}"))
    share = 100 * w / plan.rate if plan.rate > 0 else 0.0
    _fit_title(ax, f"tree {index}: root {root}\n{w:.4g} GB/s, {share:.3g}% of the data")
    _finish_axes(ax, geom)


def _topology_title(topology: Any) -> str:
    links = _pair_links(topology)
    if not links:
        return f"{topology.name}: no links"
    caps = {c for _, c1, c2, _ in links.values() for c in (c1, c2)}
    if _is_full_mesh(topology) and len(caps) == 1:
        (cap,) = caps
        kind = next(iter(links.values()))[3]
        per = {"switch": "NVSwitch", "host": "shared memory"}.get(kind, kind)
        return (f"{topology.name}: every pair {cap:.4g} GB/s each way\n"
                f"({per}, {cap * (topology.n - 1):.4g} GB/s per device)")
    notes = []
    if any(count > 1 for count, _, _, _ in links.values()):
        notes.append("thick: parallel links")
    if any(set(kinds.split("/")) & {"pcie", "host"} for _, _, _, kinds in links.values()):
        notes.append("dashed: PCIe/host")
    if any(cab != cba for _, cab, cba, _ in links.values()):
        notes.append("x/y: from the lower id / the higher")
    return f"{topology.name}: links, GB/s each way" + (f"\n({'; '.join(notes)})" if notes else "")


def _fit_title(ax: Any, text: str, largest: float = 9.0) -> None:
    """Set ``text`` as the panel's title, in a font that fits the panel's width."""
    w_in = ax.get_window_extent().width / _root(ax.figure).dpi
    longest = max(len(line) for line in text.splitlines())
    fs = min(_title_fontsize(w_in), largest, (w_in + _GAP_W) * 72 / (0.58 * longest))
    ax.set_title(text, fontsize=fs, pad=2)


def _topology_panel(ax: Any, topology: Any, geom: _Geometry, title: str | None = None,
                    largest: float = 9.0) -> None:
    scale = _points_per_unit(ax, geom)
    caps = {topology.capacity(u, v) for u, v in topology.simple_graph().edges}
    uniform = _is_full_mesh(topology) and len(caps) == 1  # the title gives the one rate
    _draw_base(ax, topology, geom, scale, set(), labels=not uniform and len(_pair_links(topology)) <= 40)
    _fit_title(ax, _topology_title(topology) if title is None else title, largest)
    _finish_axes(ax, geom)


# ---------------------------------------------------------------------- figures
def _title_fontsize(panel_w: float) -> float:
    """Points for a panel title over a panel ``panel_w`` inches wide."""
    return min(max(panel_w * 72 / 19, 4.0), 12.0)


def _title_h(panel_w: float) -> float:
    """Inches above a panel for its two-line title."""
    return (2.7 * min(_title_fontsize(panel_w), 9.0) + 4) / 72


def _grid(k: int, aspect: float) -> tuple[int, int]:
    """Rows and columns for ``k`` panels of width/height ``aspect``: the figure nearest to
    landscape 3:2, with few empty cells."""
    w = math.sqrt(_PANEL_AREA * aspect)
    cell_w, cell_h = w + _GAP_W, w / aspect + _title_h(w)

    def badness(ncols: int) -> float:
        nrows = math.ceil(k / ncols)
        shape = (ncols * cell_w) / (nrows * cell_h + _HEAD_H)
        return abs(math.log(shape / 1.5)) + 0.08 * (nrows * ncols - k)

    ncols = min(range(1, k + 1), key=badness)
    nrows = math.ceil(k / ncols)
    return nrows, math.ceil(k / nrows)


def _panel_width(nrows: int, ncols: int, aspect: float) -> float:
    """Panel width in inches: about ``_PANEL_AREA`` square inches each, shrunk to fit the largest
    sensible figure, never below ``_MIN_PANEL_W`` (past that the figure grows instead)."""
    w = math.sqrt(_PANEL_AREA * aspect)
    floor = min(w, _MIN_PANEL_W)
    while w > floor and (ncols * (w + _GAP_W) > _MAX_FIG_W
                         or nrows * (w / aspect + _title_h(w)) + _HEAD_H > _MAX_FIG_H):
        w = max(floor, w * 0.95)
    return w


def _place_panels(fig: Any, k: int, nrows: int, ncols: int, aspect: float) -> list[Any]:
    """``k`` axes in a ``nrows`` x ``ncols`` grid filling ``fig`` (a Figure or SubFigure) below
    its title band, each as large as its cell allows at the layout's aspect, centred in it."""
    fw, fh = _figure_inches(fig)
    cell_w, cell_h = fw / ncols, (fh - _HEAD_H - _FOOT_H) / nrows
    w = cell_w - _GAP_W
    for _ in range(3):  # the title band depends a little on the width
        w = min(w, (cell_h - _title_h(w)) * aspect)
    w = max(w, 0.05)
    h = w / aspect
    axes = []
    for i in range(k):
        row, col = divmod(i, ncols)
        x = col * cell_w + (cell_w - w) / 2
        y = fh - _HEAD_H - row * cell_h - _title_h(w) - h
        axes.append(fig.add_axes((x / fw, y / fh, w / fw, h / fh)))
    return axes


def _new_figure(size: tuple[float, float], interactive: bool) -> Any:
    if interactive:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=size)
    from matplotlib.figure import Figure

    return Figure(figsize=size)  # not managed by pyplot: no backend or display needed to save it


def _ring_rate(plan: Any) -> float | None:
    try:
        from jax_blink.tools.simulate import algbw, rings

        return algbw(rings(plan.topology), plan.collective)
    except Exception:  # the picture must not fail for want of a baseline
        return None


_FLOW = {
    "broadcast": "arrows: data flow, away from each tree's root (orange)",
    "reduce": "arrows: data flow, toward each tree's root (orange)",
    "allreduce": "arrows: the reduce, toward each tree's root (orange); the broadcast runs back along them",
}


def draw_plan(plan: Any, path: str | os.PathLike[str] | None = None, *, fig: Any = None,
              title: str | None = None, dpi: float = 110) -> Any:
    """Draw every tree of ``plan`` in its own panel; return the figure.

    The first panel shows the topology's links with their GB/s; then one panel per tree, in the
    plan's order, on the same layout: the links in light grey, the tree's edges as arrows in the
    direction the data flows (broadcast: away from the root; reduce and all-reduce: toward it,
    the all-reduce's broadcast going back along the same edges), its root in orange, and a title
    with the tree's root, weight (GB/s) and share of the data. The grid of panels is chosen for
    the number of trees; many trees give smaller panels, never fewer.

    Args:
        plan: a :class:`jax_blink.planning.packing.Plan`.
        path: if given, write the picture there (the suffix picks the format: .png, .pdf, .svg...).
            The figure is then not kept by pyplot unless ``fig`` was given.
        fig: a matplotlib ``Figure`` or ``SubFigure`` to draw into (its size is kept);
            default: a new figure sized for the number of panels.
        title: replaces the figure's title (the plan's rate, bound and NCCL-style rings).
        dpi: dots per inch of a written raster picture (the figure's size is in inches); raised
            (up to 300) where many trees make the panels' titles smaller than 6 points.

    Raises:
        TypeError: ``plan`` is not a plan, or ``path`` not a file name.
        FileNotFoundError / ValueError: see :func:`check_path` (checked before drawing).
    """
    for attr in ("trees", "topology", "collective", "rate"):
        if not hasattr(plan, attr):
            raise TypeError(f"draw_plan() needs a jax_blink plan (jax_blink.plan(...)), got "
                            f"{type(plan).__name__} without .{attr}")
    out = check_path(path) if path is not None else None
    _check_dpi(dpi)
    topo = plan.topology
    geom = _geometry(topo)
    aspect = (geom.xlim[1] - geom.xlim[0]) / (geom.ylim[1] - geom.ylim[0])
    k = len(plan.trees) + 1  # the links, then each tree
    nrows, ncols = _grid(k, aspect)
    made = fig is None
    if made:
        pw = _panel_width(nrows, ncols, aspect)
        size = (max(ncols * (pw + _GAP_W), _MIN_FIG_W),
                nrows * (pw / aspect + _title_h(pw)) + _HEAD_H + _FOOT_H)
        fig = _new_figure(size, interactive=out is None)
    fw, fh = _figure_inches(fig)
    axes = _place_panels(fig, k, nrows, ncols, aspect)

    _topology_panel(axes[0], topo, geom)
    axes[0].set_gid("topology")
    scale = _points_per_unit(axes[1], geom) if k > 1 else 1.0
    for i, ax in enumerate(axes[1:]):
        _draw_tree(ax, plan, i, geom, scale)
        ax.set_gid(f"tree-{i}")

    name = {"allreduce": "all-reduce"}.get(plan.collective, plan.collective)
    if title is None and topo.n == 1:
        title = f"{topo.name} {name}: one device, nothing to move"
    if title is None:
        ring = _ring_rate(plan)
        ring_s = f"; NCCL-style rings {ring:.4g}" if ring is not None else ""
        bound = float(getattr(plan, "bound", float("nan")))
        n = len(plan.trees)
        # Every rate in the picture is the model's (link rates of the topology), never a measurement.
        same = ""
        if ring is not None and _is_full_mesh(topo) and len(set(topo.capacity(a, b) for a, b in
                                                                 topo.simple_graph().edges)) == 1:
            same = "; a uniform mesh: trees and rings have the same rate here"
        title = (f"{topo.name} {name}: {n} tree{'s' if n != 1 else ''}, modelled {float(plan.rate):.4g} GB/s "
                 f"algbw per rank (cut bound {bound:.4g}{ring_s}){same}\n{_FLOW.get(plan.collective, '')}")
    longest = max(len(line) for line in title.splitlines()) if title else 1
    fs = min(12.0, max(7.0, fw * 72 / (0.56 * longest)))  # the longest line fits the width
    fig.suptitle(title, fontsize=fs, y=1 - 0.08 / fh, va="top")
    if out is not None:
        # Many trees make small panels: more dots per inch keep their titles readable when zoomed.
        smallest = min(ax.title.get_fontsize() for ax in axes)
        _save(fig, out, made, dpi if smallest >= 6 else min(max(dpi, dpi * 6 / smallest), 300))
    return fig


def draw_topology(topology: Any, path: str | os.PathLike[str] | None = None, *, ax: Any = None,
                  title: str | None = None, dpi: float = 110) -> Any:
    """Draw ``topology``'s links on its layout: one line per linked pair, thicker for parallel
    links, dashed for PCIe/host, labelled with the GB/s each way (``2×25``: two links of 25);
    a uniform mesh (NVSwitch, host devices) says its per-pair rate in the title instead.
    Returns the axes.

    Args:
        topology: a :class:`jax_blink.Topology`.
        path: if given, write the picture there (see :func:`draw_plan`).
        ax: axes to draw into (default: a new figure).
        title: replaces the title.
        dpi: dots per inch of a written raster picture.
    """
    for attr in ("devices", "simple_graph", "graph", "capacity"):
        if not hasattr(topology, attr):
            raise TypeError(f"draw_topology() needs a jax_blink.Topology, got {type(topology).__name__}")
    out = check_path(path) if path is not None else None
    _check_dpi(dpi)
    geom = _geometry(topology)
    made = ax is None
    if made:
        # Devices about 40 points across, within a sensible page.
        per_unit = 20 / 72 / geom.radius
        w = (geom.xlim[1] - geom.xlim[0]) * per_unit
        h = (geom.ylim[1] - geom.ylim[0]) * per_unit
        fit = min(1.0, _MAX_FIG_W / w, _MAX_FIG_H / h, 9.0 / max(w, h))
        w, h = max(w * fit, 3.0), h * fit
        fig = _new_figure((w, h + 0.5), interactive=out is None)
        ax = fig.add_axes((0.0, 0.0, 1.0, h / (h + 0.5)))
    _topology_panel(ax, topology, geom, title, largest=11.0)
    if out is not None:
        _save(ax.figure, out, made, dpi)
    return ax


def _root(fig: Any) -> Any:
    """The Figure that holds ``fig`` (itself, or a SubFigure's parent figure)."""
    while getattr(fig, "figure", None) is not None and fig.figure is not fig:
        fig = fig.figure
    return fig


def _figure_inches(fig: Any) -> tuple[float, float]:
    root = _root(fig)
    if root is fig:
        w, h = fig.get_size_inches()
        return float(w), float(h)
    return fig.bbox.width / root.dpi, fig.bbox.height / root.dpi  # a SubFigure


def _check_dpi(dpi: Any) -> None:
    if isinstance(dpi, bool) or not isinstance(dpi, (int, float)) or not 10 <= dpi <= 1200:
        raise ValueError(f"dpi must be a number from 10 to 1200, got {dpi!r}")


def _save(fig: Any, path: Path, made: bool, dpi: float) -> None:
    root = _root(fig)
    root.savefig(path, dpi=dpi, facecolor="white")
    if made and root.canvas.manager is not None:  # a pyplot figure we made: let pyplot forget it
        import matplotlib.pyplot as plt

        plt.close(root)
