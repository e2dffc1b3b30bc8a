"""Layer 2: cluster descriptions (links with α and β, devices per node) and an emulated topology.

* :class:`Link` -- one kind of link: α (s per message) and β (s per byte, per direction).
* :class:`EmulatedTopology` -- ranks grouped into nodes on one machine; messages that cross nodes are
  delayed as if they went through each node's slow NIC, so that a laptop can feel a cluster's topology.
* :class:`Cluster`, :func:`load_preset`, :func:`list_presets` -- node types from ``commlab/data/clusters.json``
  (DGX A100, DGX H100, a PCIe server): devices and NICs per node, intra/inter links, memory, peak FLOP/s.
"""

from commlab.topology.links import Link, flows_per_nic
from commlab.topology.emulated import EmulatedTopology
from commlab.topology.cluster import Cluster, list_presets, load_preset

__all__ = ["Link", "flows_per_nic", "EmulatedTopology", "Cluster", "list_presets", "load_preset"]
from commlab.topology.ring_order import crossings, topology_aware_ring

__all__ += ["topology_aware_ring", "crossings"]
