"""Parallelism on a device mesh (layer 5): the mesh and its process groups, tensor parallelism,
pipeline schedules, data parallelism.

One folder or module per parallel dimension. Nothing here keeps a global process-group manager:
every function takes the mesh or the group it communicates over.

* :mod:`commlab.parallel.mesh` -- :class:`ParallelLayout` (pure rank <-> (dp, pp, tp) arithmetic),
  :func:`build_mesh` (every rank creates every group, in one fixed order), :func:`mesh_groups`,
  :func:`order_report` (what a different dimension order does to which groups cross nodes).
* :mod:`commlab.parallel.tensor` -- Megatron-LM's f and g operators and the tensor-parallel layers
  built from them.
"""

__all__: list[str] = []

# Tensor-parallel and mesh exports are added below once those modules land (same engineer, same issue);
# other dimensions (pipeline, data_parallel) append their own import lines and extend __all__.
