"""Software profiles: what a training stack does, beside the cluster preset.

A :class:`SoftwareProfile` says what the stack does, not how fast it is: sequence parallelism, split pipeline
sends, which communication it overlaps with compute (shares that restate a flag: 1 on, 0 off; none fitted),
gradient and optimizer-state bytes, recomputation and the ZeRO stages it offers. :func:`load_software` reads
``commlab/data/software.json``, where every field names its flag, file or paper section (or says
``assumption:``). Book: chapter 11, §11.2 and §11.4."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

from commlab import checks, data

__all__ = ["SoftwareProfile", "SOFTWARE_PATH", "RECOMPUTE_POLICIES", "ZERO_STAGES", "DEFAULT_SOFTWARE",
           "OptimizerDtypes", "OPTIMIZER_DTYPES", "load_software", "list_software", "check_recompute_policy",
           "check_zero_stage", "optimizer_dtypes"]

#: The profile table: ``software.json`` of the package data (:mod:`commlab.data`).
SOFTWARE_PATH = data.path("software.json")

#: Recomputation policies: none; ``selective``: the attention core (Korthikanti et al. 2022, §5); ``full``: every
#: layer's forward; ``every-k``: one layer in every k (as Megatron-Core's ``recompute_num_layers``).
RECOMPUTE_POLICIES = ("none", "selective", "full", "every-k")

#: ZeRO stages (Rajbhandari et al. 2020, §5): 0 none, 1 optimizer states sharded over dp, 2 gradients too, 3
#: parameters too (FSDP).
ZERO_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class OptimizerDtypes:
    """Bytes per parameter of Adam in one precision setup: ``param_bytes`` (the stored weights), ``master_bytes``
    (fp32 main parameters, and with fp16 fp32 main gradients), ``moment_bytes`` (both moments); ``source``.
    The backward's gradients are the profile's ``grad_bytes``, not part of this."""

    name: str
    param_bytes: int
    master_bytes: int
    moment_bytes: int
    source: str

    @property
    def state_bytes(self) -> int:
        """Optimizer-state bytes per parameter, ``master_bytes + moment_bytes`` (what ZeRO-1 shards)."""
        return self.master_bytes + self.moment_bytes


_DIST_OPT = ("Megatron-LM docs/user-guide/features/dist_optimizer.md (bytes per parameter, non-distributed vs "
             "distributed optimizer over d dp ranks)")

#: Optimizer-state dtype options. With the profile's gradient bytes the totals are Megatron's table:
#: bf16 params + fp32 grads 2 + 4 + 4 + 8 = 18 (distributed: 6 + 12/d); fp16 params + fp16 grads
#: 2 + 2 + 16 = 20 (4 + 16/d); fp32 params + fp32 grads 4 + 4 + 8 = 16 (8 + 8/d).
OPTIMIZER_DTYPES = {o.name: o for o in (
    OptimizerDtypes("bf16-fp32-adam", 2, 4, 8, f"{_DIST_OPT}: bf16 parameters, fp32 main parameters and fp32 "
                    "Adam moments (Megatron-LM --main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype default "
                    "fp32); also ZeRO's K = 12 (Rajbhandari et al. 2020, section 3.1)"),
    OptimizerDtypes("fp16-fp32-adam", 2, 8, 8, f"{_DIST_OPT}: fp16 parameters and gradients, fp32 main "
                    "parameters and main gradients, fp32 Adam moments: 20 bytes, 4 + 16/d distributed"),
    OptimizerDtypes("fp32-adam", 4, 0, 8, f"{_DIST_OPT}: fp32 parameters and gradients, no separate main copy, "
                    "fp32 Adam moments: 16 bytes, 8 + 8/d distributed"),
    OptimizerDtypes("bf16-bf16-moments-adam", 2, 4, 4, "Megatron-LM --use-precision-aware-optimizer with "
                    "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (megatron/training/arguments.py): fp32 main "
                    "parameters, two bf16 moments"),
)}


def optimizer_dtypes(name) -> OptimizerDtypes:
    """The :data:`OPTIMIZER_DTYPES` entry ``name`` (an :class:`OptimizerDtypes` as it is).

    Raises:
        ValueError: an unknown name (lists the known ones).
    """
    if isinstance(name, OptimizerDtypes):
        return name
    if isinstance(name, str) and name in OPTIMIZER_DTYPES:
        return OPTIMIZER_DTYPES[name]
    raise ValueError(f"optimizer dtype option {name!r} is not one of {sorted(OPTIMIZER_DTYPES)}")


def check_zero_stage(stage) -> int:
    """``stage`` if it is one of :data:`ZERO_STAGES`.

    Raises:
        ValueError: anything else, a bool included.
    """
    if type(stage) is int and stage in ZERO_STAGES:
        return stage
    return checks.one_of("zero_stage", stage, ZERO_STAGES, note="the ZeRO stage: 0 none, 1 optimizer states, "
                         "2 + gradients, 3 + parameters / FSDP")

#: The profile ``step_time`` and ``search`` use when none is given.
DEFAULT_SOFTWARE = "generic-no-overlap"

_FRACTIONS = ("overlap_dp_grad_reduce", "overlap_dp_param_gather", "overlap_tp", "overlap_tp_backward", "overlap_pp")


def check_recompute_policy(policy) -> str:
    """``policy`` as one of :data:`RECOMPUTE_POLICIES` (True: ``"full"``, False: ``"none"``).

    Raises:
        ValueError: anything else.
    """
    if policy is True:
        return "full"
    if policy is False:
        return "none"
    if isinstance(policy, str) and policy in RECOMPUTE_POLICIES:
        return policy
    raise ValueError(f"recompute policy {policy!r} is not one of {list(RECOMPUTE_POLICIES)} (or True = 'full', "
                     "False = 'none')")


@dataclasses.dataclass(frozen=True)
class SoftwareProfile:
    """What a training stack does (book §11.2); each field's source is in ``commlab/data/software.json``.

    ``overlap_*``: shares (0..1) of the DP gradient reduction, the distributed optimizer's AllGather, the TP
    communication, the column-parallel input-gradient reductions (Korthikanti et al. 2022 §6.2) and the
    pipeline sends that may hide behind compute (:meth:`pp_overlap`); ``dp_bucket_params*``: the gradient
    bucket (:meth:`bucket_params`); ``overlap_compute_slowdown``: compute slowdown (>= 1) beside communication,
    an assumption (presets 1.189, Lee et al. 2025, measured inside a node); ``zero_stages``: the stages the
    stack offers; ``zero2_reshard_after_backward``: ZeRO-2 gathers the parameters before every forward (FSDP2's
    default) instead of once per step (DeepSpeed).

    Raises:
        ValueError: a share outside [0, 1], a slowdown below 1, an unknown recompute policy, ZeRO stage or
            optimizer dtypes, grad_bytes not 2 or 4, a negative bucket size.
    """

    name: str
    sequence_parallel: bool = True
    pp_scatter_gather: bool = False
    flash_attention: bool = True
    overlap_dp_grad_reduce: float = 0.0
    overlap_dp_param_gather: float = 0.0
    overlap_tp: float = 0.0
    overlap_tp_backward: float = 0.0
    overlap_pp: float = 0.0
    overlap_pp_needs_interleave: bool = False
    even_stages: bool = False
    dp_bucket_params: float = 0.0
    dp_bucket_params_per_dp_rank: float = 0.0
    overlap_compute_slowdown: float = 1.0
    grad_bytes: int = 2
    optimizer_dtypes: str = "bf16-fp32-adam"
    recompute: str = "full"
    recompute_every: int = 1
    zero_stages: tuple = (0, 1)
    zero2_reshard_after_backward: bool = False
    description: str = ""
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        where = f"software {self.name!r}"
        for f in _FRACTIONS:
            checks.share(f, getattr(self, f), note="0 = not overlapped, 1 = fully hidden behind compute", where=where)
        for f in ("overlap_pp_needs_interleave", "even_stages", "zero2_reshard_after_backward"):
            checks.flag(f, getattr(self, f), where=where)
        for f in ("dp_bucket_params", "dp_bucket_params_per_dp_rank"):
            checks.number(f, getattr(self, f), least=0, note="gradient elements; 0 = no buckets", where=where)
        checks.number("overlap_compute_slowdown", self.overlap_compute_slowdown, least=1, where=where,
                      note="1 = compute does not slow down while communication overlaps it")
        object.__setattr__(self, "recompute", check_recompute_policy(self.recompute))
        checks.integer("recompute_every", self.recompute_every, where=where)
        stages = tuple(self.zero_stages) if isinstance(self.zero_stages, (list, tuple)) else ()
        if not stages or list(stages) != sorted(set(stages)) or any(type(z) is not int or z not in ZERO_STAGES
                                                                     for z in stages):
            raise ValueError(f"{where}: zero_stages = {self.zero_stages!r} must list distinct ZeRO stages of "
                             f"{list(ZERO_STAGES)} in increasing order")
        object.__setattr__(self, "zero_stages", stages)
        if not isinstance(self.optimizer_dtypes, str) or self.optimizer_dtypes not in OPTIMIZER_DTYPES:
            raise ValueError(f"software {self.name!r}: optimizer_dtypes = {self.optimizer_dtypes!r} is not one of "
                             f"{sorted(OPTIMIZER_DTYPES)}")
        checks.one_of("grad_bytes", self.grad_bytes, (2, 4), note="bf16/fp16 or fp32", where=where)

    @property
    def optimizer(self) -> OptimizerDtypes:
        """The :class:`OptimizerDtypes` the profile names."""
        return OPTIMIZER_DTYPES[self.optimizer_dtypes]

    @property
    def optimizer_state_bytes(self) -> int:
        """Optimizer-state bytes per parameter of :attr:`optimizer`."""
        return self.optimizer.state_bytes

    def replace(self, **changes) -> "SoftwareProfile":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def bucket_params(self, dp: int) -> float:
        """Elements of one gradient bucket for ``dp`` ranks: ``max(dp_bucket_params, dp_bucket_params_per_dp_rank·dp)``
        (Megatron-Core's ``max(40M, 1M·dp)``); 0 = no buckets."""
        return max(self.dp_bucket_params, self.dp_bucket_params_per_dp_rank * dp)

    def pp_overlap(self, interleave: int) -> float:
        """The share of pipeline sends that hides for ``interleave`` chunks: 0 without interleaving where
        ``overlap_pp_needs_interleave``, else ``overlap_pp``."""
        return 0.0 if self.overlap_pp_needs_interleave and interleave == 1 else self.overlap_pp


def list_software(path: str | Path | None = None) -> list[str]:
    """Names of the profiles in ``path`` (default :data:`SOFTWARE_PATH`), sorted."""
    return sorted(data.load_table(path, "software.json"))


_FIELDS = tuple(f.name for f in dataclasses.fields(SoftwareProfile) if f.name not in ("name", "description",
                                                                                      "sources"))


def load_software(name: str | SoftwareProfile | None = None, path: str | Path | None = None) -> SoftwareProfile:
    """The profile ``name`` of ``commlab/data/software.json`` (None: :data:`DEFAULT_SOFTWARE`; a profile as it is);
    every field given as ``{"value": ..., "source": "..."}`` with a non-empty source.

    Raises:
        ValueError: an unknown name (lists the known ones); a field missing, unknown, without a source, or bad.
    """
    if isinstance(name, SoftwareProfile):
        return name
    name = DEFAULT_SOFTWARE if name is None else name
    table = data.load_table(path, "software.json")
    if name not in table:
        raise ValueError(f"unknown software profile {name!r}; known profiles: {sorted(table)}")
    entry = dict(table[name])
    description = entry.pop("description", "")
    unknown = set(entry) - set(_FIELDS)
    missing = set(_FIELDS) - set(entry)
    if unknown or missing:
        raise ValueError(f"software {name!r}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}; "
                         f"each profile gives exactly {list(_FIELDS)}")
    values, sources = {}, {}
    for field in _FIELDS:
        fig = entry[field]
        if not isinstance(fig, dict) or "value" not in fig:
            raise ValueError(f"software {name!r}: field {field!r} must be an object with value and source")
        src = fig.get("source")
        if not isinstance(src, str) or not src.strip():
            raise ValueError(f"software {name!r}: field {field!r} has no source; every field names the flag, "
                             "file or paper section it comes from, or starts with 'assumption:'")
        values[field], sources[field] = fig["value"], src
    return SoftwareProfile(name=name, description=description, sources=sources, **values)
