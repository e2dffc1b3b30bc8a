"""Who sends which bytes when N ranks sum a compressed gradient, on each of the three paths of
:func:`commlab.compress.aggregate.aggregate`: a ring AllReduce of a linear payload, a ring AllGather of
non-linear payloads, and the two-phase AllReduce (all-to-all of compressed chunks, then an AllGather of
the owners' recompressed chunks).

The byte counts in the labels come from the functions the aggregation itself reports them with:
:func:`commlab.collectives.ring.ring_bytes_sent_per_rank` and
:func:`commlab.compress.two_phase.two_phase_bytes_sent_per_rank`.
"""

from __future__ import annotations

from commlab import checks
from commlab.collectives.ring import ring_bytes_sent_per_rank
from commlab.compress.two_phase import two_phase_bytes_sent_per_rank
from commlab.viz.collectives import Step, circle_positions, plot_transfers

__all__ = ["compressed_path_transfers", "compressed_bytes_per_rank", "plot_compressed_paths"]


def _fmt(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.3g} B"


def compressed_bytes_per_rank(n: int, payload_nbytes: float, server_payload_nbytes: float | None = None) -> dict:
    """Bytes each rank sends on each path for a whole payload of ``payload_nbytes`` per rank.

    ``"all_reduce"``: ``2 (N-1)/N · P`` (linear payloads only); ``"all_gather"``: ``(N-1) · P``;
    ``"two_phase"``: ``(N-1) (c_w + c_s)`` with ``c_w = P/N`` and ``c_s = P_s/N`` (``P_s`` =
    ``server_payload_nbytes``, default P: the owners recompress with the same compressor).
    """
    ps = payload_nbytes if server_payload_nbytes is None else server_payload_nbytes
    return {"all_reduce": ring_bytes_sent_per_rank(payload_nbytes, n, "all_reduce"),
            "all_gather": ring_bytes_sent_per_rank(n * payload_nbytes, n, "all_gather"),
            "two_phase": two_phase_bytes_sent_per_rank(payload_nbytes / n, ps / n, n)}


def compressed_path_transfers(n: int, payload_nbytes: float,
                              server_payload_nbytes: float | None = None) -> list[Step]:
    """One panel per path (two for the two-phase AllReduce), each message an arrow labelled with the
    bytes it carries *in all* over the phase.

    * ring AllReduce: rank p to p+1, ``2(N-1)`` messages of ``P/N``;
    * ring AllGather: rank p to p+1, ``N-1`` messages of ``P`` (every other rank's payload passes by);
    * two-phase, phase 1 (all-to-all): rank i to owner j, chunk j's payload ``c_w = P/N`` (unlabelled
      arrows; the size is in the panel's title);
    * two-phase, phase 2 (ring AllGather of the owners' payloads): p to p+1, ``N-1`` messages of ``c_s``.
    """
    checks.integer("n", n, 2, note="the number of ranks N")
    ps = payload_nbytes if server_payload_nbytes is None else server_payload_nbytes
    per = compressed_bytes_per_rank(n, payload_nbytes, ps)
    ring = [(p, (p + 1) % n) for p in range(n)]
    return [
        (f"AllReduce (linear): {_fmt(per['all_reduce'])}/rank",
         [(s, d, _fmt(2 * (n - 1) * payload_nbytes / n)) for s, d in ring]),
        (f"AllGather: {_fmt(per['all_gather'])}/rank",
         [(s, d, _fmt((n - 1) * payload_nbytes)) for s, d in ring]),
        # N(N-1) arrows: the size goes in the title rather than on each arrow.
        (f"two-phase 1, all-to-all: {_fmt((n - 1) * payload_nbytes / n)}/rank\n(each arrow P/N = "
         f"{_fmt(payload_nbytes / n)})",
         [(s, d, "") for s in range(n) for d in range(n) if s != d]),
        (f"two-phase 2, AllGather: {_fmt((n - 1) * ps / n)}/rank",
         [(s, d, _fmt((n - 1) * ps / n)) for s, d in ring]),
    ]


def plot_compressed_paths(n: int = 4, payload_nbytes: float = 1e6, server_payload_nbytes: float | None = None):
    """Draw :func:`compressed_path_transfers` as a 2 x 2 grid of panels, ranks on a circle.

    Returns:
        The Figure; panel i holds one ``FancyArrowPatch`` per message of step i.
    """
    steps = compressed_path_transfers(n, payload_nbytes, server_payload_nbytes)
    return plot_transfers(steps, circle_positions(n), ncols=2, panel_inches=3.3,
                          title=f"Summing a compressed payload of P = {_fmt(payload_nbytes)} per rank on {n} ranks")
