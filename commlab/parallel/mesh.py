"""The 3D device mesh: which rank holds which (data, pipeline, tensor) coordinate, and its process groups.

:class:`ParallelLayout` is pure arithmetic, no processes: ``coords(rank) -> (dp, pp, tp)``,
``rank_of(dp, pp, tp)``, ``groups(dim)`` and ``node_of(rank)``; the default order puts TP innermost, so a
TP group is consecutive ranks inside one node, where the fast links are (TP all-reduces every layer's
activations on the critical path: Shoeybi et al. 2019, §3; Narayanan et al. 2021, §3).
:func:`build_mesh` turns a layout into a :class:`torch.distributed.device_mesh.DeviceMesh` on every rank,
after every rank has agreed on it; :func:`mesh_groups` returns this rank's group per dimension;
:func:`order_report` shows what another dimension order does.

Book: chapter 10, §10.6 (why TP stays inside a node), §10.7 (rank mapping), §10.8 (the mesh, live).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch.distributed as dist

from commlab import checks
from commlab.collectives.common import as_int64
from commlab.collectives.agreement import agree
from commlab.launch.device import group_device

__all__ = ["MESH_DIMS", "ParallelLayout", "check_order", "check_layout", "build_mesh", "mesh_groups",
           "cross_node_groups", "order_report"]

#: The dimension names a mesh may use, and the default order (outermost first, TP innermost).
MESH_DIMS: tuple[str, str, str] = ("dp", "pp", "tp")


def check_order(order: Sequence[str]) -> tuple[str, str, str]:
    """Validate a mesh dimension order and return it as a tuple.

    Args:
        order: the three names ``"dp"``, ``"pp"``, ``"tp"`` in some order, outermost first (the last one
            varies fastest with the rank).

    Raises:
        ValueError: not three names, a name that is not one of ``dp``/``pp``/``tp``, or a name twice.
    """
    if isinstance(order, str):
        raise ValueError(f"order must be a sequence of dimension names such as {MESH_DIMS}, got the string "
                         f"{order!r}")
    order = tuple(order)
    unknown = [d for d in order if d not in MESH_DIMS]
    if unknown:
        raise ValueError(f"unknown mesh dimension name(s) {unknown} in order {order}; the names are {MESH_DIMS}")
    duplicated = sorted({d for d in order if order.count(d) > 1})
    if duplicated:
        raise ValueError(f"duplicate mesh dimension name(s) {duplicated} in order {order}; each of {MESH_DIMS} "
                         "must appear exactly once")
    if len(order) != len(MESH_DIMS):
        missing = [d for d in MESH_DIMS if d not in order]
        raise ValueError(f"order must name all {len(MESH_DIMS)} dimensions {MESH_DIMS}, got {len(order)} "
                         f"names {order} (missing {missing}); a dimension you do not use has size 1")
    return order  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three parallel dimensions and of a node: the arithmetic of a 3D layout.

    Ranks are numbered row-major over the mesh shape in ``order`` (default ``("dp", "pp", "tp")``): the last
    dimension varies fastest. With the default order ``rank = (dp * PP + pp) * TP + tp``, so a TP group
    is ``TP`` consecutive ranks and, since ``TP`` divides ``devices_per_node``, sits inside one node;
    a PP group is strided by ``TP``; a DP group by ``PP * TP``. Node ``k`` holds ranks
    ``k * devices_per_node ... (k + 1) * devices_per_node - 1`` (how launchers number ranks).

    Attributes:
        dp, pp, tp: data-, pipeline- and tensor-parallel sizes (each an int >= 1).
        devices_per_node: accelerators (or CPU processes playing them) per node.

    Raises:
        ValueError: a size that is not an int >= 1, or ``tp`` not dividing ``devices_per_node`` (the
            message says why TP must stay inside a node).
    """

    dp: int
    pp: int
    tp: int
    devices_per_node: int

    def __post_init__(self):
        for name in ("dp", "pp", "tp", "devices_per_node"):
            checks.integer(name, getattr(self, name))
        if self.devices_per_node % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide devices_per_node={self.devices_per_node}: some tensor-parallel "
                "group would then span two nodes. TP all-reduces activations in every layer, forward and "
                "backward, on the critical path, so it must stay on the fast links inside a node; choose a tp "
                f"that divides {self.devices_per_node} (e.g. {_divisors(self.devices_per_node)}) and put the "
                "rest into pp or dp")

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """``dp * pp * tp``: the number of ranks the layout needs."""
        return self.dp * self.pp * self.tp

    @property
    def num_nodes(self) -> int:
        """Nodes the layout occupies: ``ceil(world_size / devices_per_node)``."""
        return -(-self.world_size // self.devices_per_node)

    def size(self, dim: str) -> int:
        """Size of dimension ``dim`` (``"dp"``, ``"pp"`` or ``"tp"``); ValueError for another name."""
        if dim not in MESH_DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; the names are {MESH_DIMS}")
        return getattr(self, dim)

    def shape(self, order: Sequence[str] = MESH_DIMS) -> tuple[int, int, int]:
        """The mesh shape in ``order``, e.g. ``(dp, pp, tp)`` for the default order."""
        return tuple(self.size(d) for d in check_order(order))  # type: ignore[return-value]

    # -- rank <-> coordinates ----------------------------------------------------------------------------
    def coords(self, rank: int, order: Sequence[str] = MESH_DIMS) -> tuple[int, int, int]:
        """``(dp, pp, tp)`` coordinates of global ``rank``, always in that order whatever ``order`` is.

        Raises:
            ValueError: ``rank`` not an int in ``0 .. world_size - 1``; a bad ``order``.
        """
        order = check_order(order)
        self._check_rank(rank)
        coord = {}
        rest = rank
        for dim in reversed(order):  # the last dimension varies fastest
            rest, coord[dim] = divmod(rest, self.size(dim))
        return coord["dp"], coord["pp"], coord["tp"]

    def rank_of(self, dp: int, pp: int, tp: int, order: Sequence[str] = MESH_DIMS) -> int:
        """The global rank at coordinates ``(dp, pp, tp)``; the inverse of :meth:`coords`.

        Raises:
            ValueError: a coordinate outside ``0 .. size - 1`` of its dimension; a bad ``order``.
        """
        order = check_order(order)
        coord = {"dp": dp, "pp": pp, "tp": tp}
        rank = 0
        for dim in order:
            c, n = coord[dim], self.size(dim)
            checks.integer(f"{dim} coordinate", c, 0, n - 1, note=f"the {dim} size is {n}")
            rank = rank * n + c
        return rank

    def groups(self, dim: str, order: Sequence[str] = MESH_DIMS) -> list[list[int]]:
        """Every process group of dimension ``dim``, as sorted lists of global ranks.

        A group of ``dim`` is the set of ranks whose other two coordinates are equal. The groups are listed
        by their smallest rank. For the default order and ``ParallelLayout(2, 2, 2, 8)``: ``tp`` ->
        ``[[0, 1], [2, 3], [4, 5], [6, 7]]``, ``pp`` -> ``[[0, 2], [1, 3], [4, 6], [5, 7]]``,
        ``dp`` -> ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.

        Raises:
            ValueError: ``dim`` not one of ``dp``/``pp``/``tp``; a bad ``order``.
        """
        self.size(dim)
        order = check_order(order)
        index = MESH_DIMS.index(dim)
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank, order)
            by_key.setdefault(c[:index] + c[index + 1:], []).append(rank)
        return sorted(by_key.values())

    def group_of(self, rank: int, dim: str, order: Sequence[str] = MESH_DIMS) -> list[int]:
        """The ranks of ``rank``'s group along ``dim`` (including ``rank``), sorted."""
        self.size(dim)
        c = list(self.coords(rank, order))
        index = MESH_DIMS.index(dim)
        members = []
        for i in range(self.size(dim)):
            c[index] = i
            members.append(self.rank_of(*c, order=order))
        return sorted(members)

    def node_of(self, rank: int) -> int:
        """The node that holds global ``rank``: ``rank // devices_per_node``."""
        self._check_rank(rank)
        return rank // self.devices_per_node

    def _check_rank(self, rank) -> None:
        checks.integer("rank", rank, 0, self.world_size - 1,
                       note=f"world size {self.world_size} = dp {self.dp} x pp {self.pp} x tp {self.tp}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cross_node_groups(layout: ParallelLayout, order: Sequence[str] = MESH_DIMS) -> dict[str, list[list[int]]]:
    """For each dimension, the groups whose ranks sit on more than one node under ``order``.

    Returns:
        ``{"dp": [...], "pp": [...], "tp": [...]}``, each a list of rank lists (empty when every group of
        that dimension is inside one node).
    """
    out = {}
    for dim in MESH_DIMS:
        out[dim] = [g for g in layout.groups(dim, order)
                    if len({layout.node_of(r) for r in g}) > 1]
    return out


def order_report(layout: ParallelLayout, order: Sequence[str] = ("tp", "pp", "dp")) -> str:
    """What changes when the mesh order is ``order`` instead of the default ``("dp", "pp", "tp")``.

    For each dimension: its groups under both orders and how many of them cross nodes. With
    ``ParallelLayout(2, 2, 2, devices_per_node=4)`` (two nodes of four) the default order keeps both TP groups
    of a node inside it; the flipped order ``("tp", "pp", "dp")`` makes TP the outermost dimension, its groups
    ``[0, 4], [1, 5], ...`` then join a rank of node 0 with one of node 1, and every TP all-reduce would
    cross the slow inter-node link, while the DP groups become consecutive ranks inside a node.

    Returns:
        A few lines of plain text, one per dimension and order (deterministic, for notebooks).
    """
    order = check_order(order)
    lines = [f"{layout.dp} dp x {layout.pp} pp x {layout.tp} tp on {layout.num_nodes} node(s) of "
             f"{layout.devices_per_node} devices"]
    for name, o in (("default", MESH_DIMS), ("given", order)):
        crossing = cross_node_groups(layout, o)
        lines.append(f"order {o} ({name}):")
        for dim in MESH_DIMS:
            groups = layout.groups(dim, o)
            n_cross = len(crossing[dim])
            where = "all inside a node" if n_cross == 0 else f"{n_cross} of {len(groups)} cross nodes"
            lines.append(f"  {dim}: {groups}  ({where})")
    return "\n".join(lines)


def check_layout(layout: ParallelLayout, world_size: int, order: Sequence[str] = MESH_DIMS) -> tuple[str, str, str]:
    """The checks :func:`build_mesh` makes before it creates any group, without processes.

    Returns:
        ``order`` as a validated tuple.

    Raises:
        TypeError: ``layout`` is not a :class:`ParallelLayout`.
        ValueError: a bad ``order`` (see :func:`check_order`); ``world_size`` not an int >= 1; the product
            ``dp * pp * tp`` differs from ``world_size`` (the message gives both numbers).
    """
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
    order = check_order(order)
    checks.integer("world_size", world_size)
    if layout.world_size != world_size:
        raise ValueError(f"the layout needs dp {layout.dp} x pp {layout.pp} x tp {layout.tp} = {layout.world_size} "
                         f"ranks but the world has {world_size}; choose sizes whose product is {world_size}")
    return order


def build_mesh(layout: ParallelLayout, world_size: int | None = None, order: Sequence[str] = MESH_DIMS,
               device_type: str | None = None):
    """Create the 3D device mesh of ``layout`` on this rank; every rank of the world must call it.

    Every rank creates *every* group of every dimension, in one fixed order (as
    :func:`torch.distributed.device_mesh.init_device_mesh` does): ``dist.new_group`` is collective over the
    whole world, and ranks that create different groups (the source article's ``NCCLCommunicationOptimizer``,
    book §10.13) pair them up wrongly. Before creating anything, the ranks exchange their ``(layout, order)``
    (one all-gather of 9 int64 per rank), so a rank that passed something different makes every rank raise.

    Args:
        layout: the sizes; ``dp * pp * tp`` must equal the world size.
        world_size: expected world size, checked against ``dist.get_world_size()`` (default: that).
        order: mesh dimension names, outermost first; the default ``("dp", "pp", "tp")`` keeps TP innermost.
        device_type: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` under NCCL, else ``"cpu"``.

    Returns:
        A ``DeviceMesh`` of shape ``layout.shape(order)`` with ``mesh_dim_names == order``;
        ``mesh.get_group("tp")`` is this rank's TP group (see :func:`mesh_groups`).

    Raises:
        RuntimeError: torch.distributed is not initialised; or the mesh's groups differ from the layout's
            arithmetic (a torch behaviour change).
        ValueError: on every rank: ``world_size`` differs from the process group's size; the layout's product
            differs from the world size; a bad ``order``; ranks passed different layouts or orders.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run inside commlab.launch(...) or call "
                           "dist.init_process_group first")
    actual = dist.get_world_size()
    problem = None
    try:
        if world_size is not None and world_size != actual:
            raise ValueError(f"world_size={world_size!r} was passed but the process group has {actual} ranks")
        order = check_layout(layout, actual, order)
    except (TypeError, ValueError) as exc:
        problem = exc
    _agree(layout, order, problem)
    order = tuple(order)
    if device_type is None:
        device_type = group_device(None).type
    mesh = init_device_mesh(device_type, layout.shape(order), mesh_dim_names=order)
    me = dist.get_rank()
    for dim in MESH_DIMS:  # cheap, local: the mesh must agree with the arithmetic the course teaches
        got = sorted(dist.get_process_group_ranks(mesh.get_group(dim)))
        want = layout.group_of(me, dim, order)
        if got != want:
            raise RuntimeError(f"rank {me}: the device mesh's {dim} group is {got} but the layout gives {want}")
    return mesh


def _agree(layout, order, problem: Exception | None) -> None:
    """All ranks exchange what they were given; all raise the same error if anything is wrong anywhere."""
    sizes = [as_int64(getattr(layout, n, None)) for n in ("dp", "pp", "tp", "devices_per_node")]
    names = list(order) if not isinstance(order, str) else [order]
    codes = [(MESH_DIMS.index(d) if d in MESH_DIMS else -1) for d in names[:3]]
    codes += [-1] * (3 - len(codes)) + [len(names)]

    def differ(rows: list[list[int]]) -> str | None:
        if len({tuple(r[:-1]) for r in rows}) == 1 and len({r[-1] for r in rows}) > 1:
            # Same layout and order everywhere, but some ranks rejected their own world_size argument.
            bad = [i for i, r in enumerate(rows) if not r[-1]]
            return (f"ranks {bad} rejected their arguments (a world_size that is not the process group's size) "
                    "while the others accepted theirs; pass the same arguments on every rank")
        if len({tuple(r) for r in rows}) > 1:
            def describe(r):
                dims = tuple(MESH_DIMS[c] if c >= 0 else "?" for c in r[4:7])
                return f"(dp={r[0]}, pp={r[1]}, tp={r[2]}, devices_per_node={r[3]}, order={dims})"
            who = "; ".join(f"rank {i}: {describe(r)}" for i, r in enumerate(rows))
            return f"ranks passed different layouts or orders ({who}); every rank must pass the same layout and order"
        return None

    # The rank's own verdict travels as the row's last entry, so that a valid rank does not wait for one that
    # gave up; with the same inputs everywhere, every rank raises its own (identical) problem below.
    agree("build_mesh", sizes + codes + [int(problem is None)], None, ints=True, differ=differ)
    if problem is not None:  # the same inputs everywhere, so the same problem everywhere
        raise problem


def mesh_groups(mesh) -> dict[str, dist.ProcessGroup]:
    """This rank's process group for each named dimension of ``mesh``: ``{"dp": ..., "pp": ..., "tp": ...}``.

    The groups are ``mesh.get_group(name)``; pass them explicitly to the functions that communicate.
    """
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("the mesh has no dimension names; build it with build_mesh or mesh_dim_names=...")
    return {name: mesh.get_group(name) for name in names}
