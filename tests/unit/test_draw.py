"""Pictures of plans and topologies: every tree in its own panel with every edge drawn, the
direction of the data flow, the fixed layouts, the files written, and clear errors for bad paths.
Nothing here looks at pixels: the figure's artists are counted against the plan."""

import math

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch  # noqa: E402

from jax_blink.tools import draw  # noqa: E402
from jax_blink.planning.topology import Topology  # noqa: E402
from jax_blink.planning.packing import Plan, plan  # noqa: E402

DGX1V = Topology.preset("dgx1v")
GRID = Topology.from_links({**{(i, i + 1): 25.0 for i in (0, 1, 2, 4, 5, 6)},
                            **{(i, i + 4): 50.0 for i in range(4)}}, name="grid2x4")


@pytest.fixture(scope="module")
def plans():
    return {
        "dgx1v allreduce": plan(DGX1V, "allreduce"),
        "dgx1v broadcast": plan(DGX1V, "broadcast", 0),
        "dgx1p reduce": plan(Topology.preset("dgx1p"), "reduce", 3),
        "dgx1v[0,1,4] allreduce": plan(DGX1V.subset([0, 1, 4]), "allreduce"),
        "host:8 allreduce": plan(Topology.host(8), "allreduce"),
        "dgx2 allreduce": plan(Topology.preset("dgx2"), "allreduce"),
        "grid2x4 broadcast": plan(GRID, "broadcast", 5),
    }


def _panels(fig):
    axes = {ax.get_gid(): ax for ax in fig.axes}
    assert len(axes) == len(fig.axes), "two panels share a name"
    return axes


def _arrows(ax):
    return [p for p in ax.patches if isinstance(p, FancyArrowPatch) and p.get_gid() == "tree-edge"]


def _pairs(topology):
    return {(min(u, v), max(u, v)) for u, v in topology.simple_graph().edges}


@pytest.mark.parametrize("name", ["dgx1v allreduce", "dgx1v broadcast", "dgx1p reduce", "dgx1v[0,1,4] allreduce",
                                  "host:8 allreduce", "dgx2 allreduce", "grid2x4 broadcast"])
def test_every_tree_has_its_panel_with_every_edge_in_the_data_direction(plans, name):
    p = plans[name]
    fig = draw.draw_plan(p)
    try:
        panels = _panels(fig)
        assert set(panels) == {"topology"} | {f"tree-{i}" for i in range(p.num_trees)}
        pairs = _pairs(p.topology)
        for i, ((tree, w), root) in enumerate(zip(p.trees, p.roots)):
            ax = panels[f"tree-{i}"]
            drawn = [a.get_label() for a in _arrows(ax)]
            # reduce and all-reduce: the data flows toward the root, against the tree's edges.
            flow = [(u, v) for u, v in tree.edges] if p.collective == "broadcast" else [(v, u) for u, v in tree.edges]
            assert sorted(drawn) == sorted(f"{a}->{b}" for a, b in flow), f"tree {i}"
            assert len(drawn) == p.topology.n - 1
            # The root is marked, and only it.
            roots = [c.get_label() for c in ax.patches if isinstance(c, Circle) and c.get_gid() == "root"]
            assert roots == [str(root)]
            assert sum(isinstance(c, Circle) for c in ax.patches) == p.topology.n
            # The machine's links under every tree, one line per linked pair.
            (links,) = [c for c in ax.collections if isinstance(c, LineCollection) and c.get_gid() == "links"]
            assert len(links.get_segments()) == len(pairs)
            title = ax.get_title()
            assert f"root {root}" in title and f"{w:.4g} GB/s" in title and f"{100 * w / p.rate:.3g}%" in title
        assert len(_arrows(panels["topology"])) == 0
    finally:
        plt.close(fig)


def test_many_trees_all_drawn_on_smaller_panels_in_a_bounded_figure():
    # 40 trees (more than any real plan of 4 devices): every one gets a panel, the figure stays
    # about a page, and the panels shrink instead.
    topo = Topology.preset("nvswitch:4")
    base = plan(topo, "allreduce")
    trees = tuple(base.trees[i % base.num_trees] for i in range(40))
    roots = tuple(base.roots[i % base.num_trees] for i in range(40))
    rate = sum(w for _, w in trees)
    many = Plan("allreduce", None, trees, rate, rate, topo, "exact", roots)
    fig = draw.draw_plan(many)
    try:
        panels = _panels(fig)
        assert len(panels) == 41
        assert all(len(_arrows(panels[f"tree-{i}"])) == 3 for i in range(40))
        w, h = fig.get_size_inches()
        assert w <= draw._MAX_FIG_W + 0.5 and h <= draw._MAX_FIG_H + 0.5
        few = draw.draw_plan(base)
        small = panels["tree-0"].get_window_extent().width
        assert small < 0.8 * few.axes[1].get_window_extent().width
        plt.close(few)
    finally:
        plt.close(fig)


def test_panels_do_not_overlap_and_stay_inside_the_figure(plans):
    fig = draw.draw_plan(plans["dgx1v allreduce"])
    try:
        boxes = [ax.get_position() for ax in fig.axes]
        for b in boxes:
            assert 0 <= b.x0 < b.x1 <= 1 and 0 <= b.y0 < b.y1 <= 1
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0
    finally:
        plt.close(fig)


def test_files_are_written_in_the_format_of_their_suffix(plans, tmp_path):
    png, svg = tmp_path / "trees.png", tmp_path / "links.svg"
    assert isinstance(draw.draw_plan(plans["dgx1v[0,1,4] allreduce"], png), Figure)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    draw.draw_topology(DGX1V, str(svg))
    assert b"<svg" in svg.read_bytes()[:2000]
    assert plt.get_fignums() == []  # figures made only to be saved are not left with pyplot


def test_draws_into_the_subfigures_of_a_users_figure(plans, tmp_path):
    fig = Figure(figsize=(14, 5))
    left, right = fig.subfigures(1, 2)
    draw.draw_plan(plans["dgx1v[0,1,4] allreduce"], fig=left)
    draw.draw_plan(plans["host:8 allreduce"], fig=right, title="eight host devices")
    assert len(left.axes) == 4 and len(right.axes) == 9
    assert right._suptitle.get_text() == "eight host devices"
    fig.savefig(tmp_path / "both.png")
    assert (tmp_path / "both.png").stat().st_size > 0


@pytest.mark.parametrize("path, error, words", [
    ("{tmp}/no/such/folder/trees.png", FileNotFoundError, ["does not exist", "no/such/folder"]),
    ("{tmp}/trees.xyz", ValueError, ["unknown picture format '.xyz'", ".png", ".svg"]),
    ("{tmp}/trees", ValueError, ["no file name suffix", ".png"]),
])
def test_bad_paths_are_refused_before_drawing(plans, tmp_path, path, error, words):
    path = path.format(tmp=tmp_path)
    for call in (lambda: draw.draw_plan(plans["host:8 allreduce"], path), lambda: draw.draw_topology(DGX1V, path)):
        with pytest.raises(error) as e:
            call()
        for w in words:
            assert w in str(e.value)
    assert list(tmp_path.iterdir()) == []
    assert plt.get_fignums() == []


def test_wrong_argument_types_are_named(plans, tmp_path):
    with pytest.raises(ValueError, match="dpi must be a number from 10 to 1200, got 0"):
        draw.draw_plan(plans["host:8 allreduce"], tmp_path / "t.png", dpi=0)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="file name"):
        draw.draw_plan(plans["host:8 allreduce"], 42)
    with pytest.raises(TypeError, match="needs a jax_blink plan"):
        draw.draw_plan(DGX1V)
    with pytest.raises(TypeError, match="needs a jax_blink.Topology"):
        draw.draw_topology(plans["host:8 allreduce"])


def test_dgx1_layout_is_two_quads_side_by_side_with_their_diagonals():
    pos = draw.layout(DGX1V)
    left, right = [pos[i] for i in range(4)], [pos[i] for i in range(4, 8)]
    assert max(x for x, _ in left) < min(x for x, _ in right)
    for quad in (left, right):  # a square: four corners, two distinct x and two distinct y
        assert len({x for x, _ in quad}) == 2 and len({y for _, y in quad}) == 2
    assert all(pos[i][1] == pos[i + 4][1] for i in range(4))  # GPU i beside GPU i + 4
    # Subsets keep the machine's places.
    assert draw.layout(DGX1V.subset([4, 0, 1])) == {d: pos[d] for d in (4, 0, 1)}


@pytest.mark.parametrize("topo", [Topology.preset("dgx2"), Topology.host(8), Topology.preset("nvswitch:4")],
                         ids=lambda t: t.name)
def test_uniform_meshes_sit_on_a_circle_in_device_order(topo):
    pos = draw.layout(topo)
    assert all(abs(math.hypot(*pos[d]) - 1) < 1e-9 for d in topo.devices)
    angles = [math.atan2(pos[d][0], pos[d][1]) % (2 * math.pi) for d in topo.devices]
    assert angles == sorted(angles)  # clockwise from the top


def test_user_topologies_get_a_layout_without_needless_crossings():
    # A 2 x 4 grid and a 4 x 4 mesh are planar: no two links cross.
    mesh = Topology.from_links({**{(r * 4 + c, r * 4 + c + 1): 20.0 for r in range(4) for c in range(3)},
                                **{(r * 4 + c, r * 4 + c + 4): 20.0 for r in range(3) for c in range(4)}})
    for topo in (GRID, mesh):
        und = topo.simple_graph().to_undirected().edges
        assert draw._crossings(draw.layout(topo), und) == 0


@pytest.mark.parametrize("topo", [DGX1V, Topology.preset("dgx1v", pcie=True), DGX1V.subset([0, 1, 4]),
                                  Topology.preset("dgx2"), GRID], ids=lambda t: t.name)
def test_no_link_is_drawn_through_another_device(topo):
    geom = draw._geometry(topo)
    for (a, b), c in geom.control.items():
        for t in range(1, 40):
            q = draw._bezier(geom.pos[a], c, geom.pos[b], t / 40)
            for d, p in geom.pos.items():
                if d not in (a, b):
                    assert math.dist(q, p) > geom.radius, f"link {a}-{b} runs through device {d}"


def test_topology_picture_labels_each_pair_with_its_links_and_rate():
    ax = draw.draw_topology(DGX1V)
    try:
        labels = sorted(t.get_text() for t in ax.texts if t.get_gid() == "link-label")
        # dgx1v: 8 pairs with two links of 25 GB/s, 8 with one.
        assert labels == ["25"] * 8 + ["2\u00d725"] * 8
        (links,) = [c for c in ax.collections if c.get_gid() == "links"]
        assert len(links.get_segments()) == 16
    finally:
        plt.close(ax.figure)
    ax = draw.draw_topology(Topology.preset("dgx2"))
    try:
        assert "every pair 10 GB/s each way" in ax.get_title()
        assert not [t for t in ax.texts if t.get_gid() == "link-label"]  # one rate for all: said once
        assert sorted(int(t.get_text()) for t in ax.texts if t.get_gid() == "device-label") == list(range(16))
    finally:
        plt.close(ax.figure)


def test_labels_of_mixed_parallel_and_one_way_links():
    # 0-1: an NVLink of 25 and a PCIe link of 10 (one pair, 35 in all); 1-2: two NVLinks of 25;
    # 2-3: PCIe, 10 one way and 5 the other; 0-3: one NVLink of 20.
    links = [(0, 1, 25.0, "nvlink"), (0, 1, 10.0, "pcie"), (1, 2, 25.0, "nvlink"), (1, 2, 25.0, "nvlink"),
             (0, 3, 20.0, "nvlink")]
    both = [e for u, v, c, k in links for e in ((u, v, c, k), (v, u, c, k))]
    topo = Topology(range(4), both + [(2, 3, 10.0, "pcie"), (3, 2, 5.0, "pcie")], name="mixed")
    ax = draw.draw_topology(topo)
    try:
        assert sorted(t.get_text() for t in ax.texts if t.get_gid() == "link-label") == ["10/5", "20", "2\u00d725", "35"]
        assert "x/y: from the lower id / the higher" in ax.get_title()
        assert "dashed: PCIe/host" in ax.get_title()
    finally:
        plt.close(ax.figure)


def test_titles_say_the_rates_are_modelled_and_when_trees_equal_rings(plans):
    """The figure's title labels its numbers as the model's; on a uniform mesh (host devices, a
    switch) it says trees and rings have the same rate there, and not on a DGX-1 allocation."""
    uniform = draw.draw_plan(plans["host:8 allreduce"])._suptitle.get_text()
    assert "modelled 40 GB/s algbw per rank" in uniform and "NCCL-style rings 40" in uniform
    assert "uniform mesh: trees and rings have the same rate here" in uniform
    partial = draw.draw_plan(plans["dgx1v[0,1,4] allreduce"])._suptitle.get_text()
    assert "modelled" in partial and "uniform" not in partial
    plt.close("all")


def test_a_file_in_the_way_of_the_folder_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(FileNotFoundError, match="a-file' is a file, not a folder"):
        draw.check_path(blocker / "sub" / "trees.png")
