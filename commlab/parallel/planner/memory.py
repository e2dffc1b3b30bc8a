"""Memory per GPU of a 3D-parallel (TP × PP × DP) transformer training layout, in bytes.

:class:`ModelConfig` (:func:`load_model` reads ``commlab/data/models.json``) and :class:`Layout` (tp, pp, dp,
micro-batch, ZeRO stage, HSDP, recomputation, interleaving, sequence parallelism); :func:`memory_breakdown`
gives the :class:`MemoryBreakdown` of the stage that needs the most; :func:`usable_memory_bytes` keeps
:data:`DEFAULT_MEMORY_RESERVE` free and :func:`is_fragile` flags a plan near the limit. Sources: Rajbhandari
et al. 2020 §3.1, §5; Korthikanti et al. 2022 §4-5; Narayanan et al. 2021 §2.2.1. Book: chapter 11, §11.1;
chapter 12, §12.4."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from commlab import checks, data
from commlab.arithmetic import ADAM_STATE_BYTES_PER_PARAM
from commlab.parallel.planner.software import (OPTIMIZER_DTYPES, OptimizerDtypes, check_recompute_policy,
                                               check_zero_stage, optimizer_dtypes)

__all__ = ["ModelConfig", "Layout", "MemoryBreakdown", "MODELS_PATH", "ADAM_STATE_BYTES_PER_PARAM",
           "DEFAULT_MEMORY_RESERVE", "DEFAULT_FRAGILE_MARGIN", "OPTIMIZER_DTYPES", "load_model", "list_models",
           "layer_params", "stage_layers", "parameter_count", "stage_params", "activation_bytes_per_layer",
           "interleave_memory_factor", "model_state_bytes_per_param", "usable_memory_bytes", "is_fragile",
           "memory_breakdown"]

#: The model table: ``models.json`` of the package data (:mod:`commlab.data`).
MODELS_PATH = data.path("models.json")

#: Share of device memory kept free by default for what the model does not count (CUDA context, NCCL
#: buffers, allocator fragmentation, workspaces): a documented default, not measured or cited -- no source
#: checked gives one, and how much a caching allocator needs free depends on the run.
DEFAULT_MEMORY_RESERVE = 0.10

#: A plan whose need is within this share of the usable memory is flagged fragile (:func:`is_fragile`).
DEFAULT_FRAGILE_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder-only transformer: ``layers`` L, ``hidden`` h, ``heads`` a, ``kv_heads`` (grouped-query
    attention; default ``heads``), ``ffn``, ``vocab`` V, ``seq`` s (training tokens); ``gated_ffn`` (SwiGLU,
    three ``h × ffn`` matrices), ``bias`` (GPT biases and LayerNorm; False: Llama's RMSNorm), ``learned_positions``,
    ``tied_embeddings``; ``reported_params`` and ``source`` for checking.

    Raises:
        ValueError: a size not a positive int; ``hidden`` not divisible by ``heads``, or ``heads`` by ``kv_heads``.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    gated_ffn: bool = False
    bias: bool = True
    learned_positions: bool = True
    tied_embeddings: bool = True
    reported_params: float | None = None
    source: str = ""

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "ffn", "vocab", "seq"):
            checks.integer(f, getattr(self, f), where=f"model {self.name!r}")
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        checks.integer("kv_heads", self.kv_heads, where=f"model {self.name!r}")
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name!r}: hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads={self.heads} is not divisible by kv_heads={self.kv_heads}")

    @property
    def params(self) -> int:
        """Total parameters, embeddings included (:func:`parameter_count`)."""
        return parameter_count(self)

    def with_seq(self, seq: int) -> "ModelConfig":
        """The same model trained at another sequence length (tokens)."""
        return dataclasses.replace(self, seq=seq)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a training step: ``tp``, ``pp``, ``dp`` (GPUs tp·pp·dp), ``micro_batch`` b, ``zero_stage``
    0-3 (``zero1``: the older spelling, kept equal to ``zero_stage >= 1``), ``recompute`` (a policy of
    :data:`~.software.RECOMPUTE_POLICIES`; True/False read as full/none) with ``recompute_every`` k,
    ``interleave`` v (chunks per GPU, Narayanan et al. 2021 §2.2.2), ``sequence_parallel``, ``flash_attention``,
    and ``dp_shard`` (HSDP: ZeRO shards over groups of that many DP ranks, replicated across ``dp/dp_shard``;
    None: all of dp).

    Raises:
        ValueError: a size not an int >= 1; an unknown policy or stage; ``zero1=True`` with ``zero_stage=0``;
            ``dp_shard`` not dividing dp, or without ZeRO.
    """

    tp: int
    pp: int
    dp: int
    micro_batch: int = 1
    zero1: bool = False
    recompute: str = "none"
    interleave: int = 1
    sequence_parallel: bool = True
    flash_attention: bool = True
    recompute_every: int = 1
    zero_stage: int | None = None
    dp_shard: int | None = None

    def __post_init__(self):
        for f in ("tp", "pp", "dp", "micro_batch", "interleave", "recompute_every"):
            if type(getattr(self, f)) is not int or getattr(self, f) < 1:  # (the search builds thousands)
                checks.integer(f, getattr(self, f))
        object.__setattr__(self, "recompute", check_recompute_policy(self.recompute))
        if self.zero_stage is None:
            object.__setattr__(self, "zero_stage", 1 if self.zero1 else 0)
        check_zero_stage(self.zero_stage)
        if self.zero1 and self.zero_stage == 0:
            raise ValueError("zero1=True contradicts zero_stage=0: give zero_stage alone (0-3)")
        object.__setattr__(self, "zero1", self.zero_stage >= 1)
        if self.dp_shard is not None:
            checks.integer("dp_shard", self.dp_shard)
            if self.dp % self.dp_shard:
                raise ValueError(f"dp_shard={self.dp_shard} does not divide dp={self.dp}: HSDP shards over groups of "
                                 f"dp_shard DP ranks and replicates across dp/dp_shard of them")
            if self.zero_stage == 0:
                raise ValueError(f"dp_shard={self.dp_shard} needs a ZeRO stage >= 1: without ZeRO nothing is sharded")
            if self.dp_shard == self.dp:
                object.__setattr__(self, "dp_shard", None)  # sharding over all of dp is plain ZeRO

    @property
    def shard_ranks(self) -> int:
        """The DP ranks ZeRO shards over: ``dp_shard`` with HSDP, else dp."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def replicas(self) -> int:
        """HSDP's replica groups, ``dp / shard_ranks`` (1 without HSDP)."""
        return self.dp // self.shard_ranks

    @property
    def gpus(self) -> int:
        """tp · pp · dp."""
        return self.tp * self.pp * self.dp

    def short(self) -> str:
        """A one-line label such as ``tp8 pp16 dp128 b1 v4 zero1 recompute``."""
        s = f"tp{self.tp} pp{self.pp} dp{self.dp} b{self.micro_batch}"
        if self.interleave > 1:
            s += f" v{self.interleave}"
        if self.zero_stage:
            s += f" zero{self.zero_stage}"
        if self.dp_shard is not None:
            s += f" hsdp{self.dp_shard}x{self.replicas}"
        if self.recompute == "full":
            s += " recompute"
        elif self.recompute == "selective":
            s += " selective"
        elif self.recompute == "every-k":
            s += f" recompute-every-{self.recompute_every}"
        return s


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU of the stage that needs the most (``stage``: first, last or only): the four parts, ``params``
    (this GPU's parameter count, before ZeRO-3) and ``in_flight`` (micro-batches held, interleaving included)."""

    params: float
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    in_flight: float
    stage: str

    @property
    def total_bytes(self) -> float:
        """Sum of the four parts, bytes."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    def fits(self, device_memory_bytes: float, usable_fraction: float = 1.0) -> bool:
        """Whether ``total_bytes <= usable_fraction × device_memory_bytes``.

        Raises:
            ValueError: ``device_memory_bytes <= 0`` or ``usable_fraction`` not in (0, 1].
        """
        if not 0 < usable_fraction <= 1:
            raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction!r}")
        return self.total_bytes <= usable_memory_bytes(device_memory_bytes, 1 - usable_fraction)


# ----------------------------------------------------------------------------------------- the table

def list_models(path: str | Path | None = None) -> list[str]:
    """Names of the models in ``path`` (default :data:`MODELS_PATH`), sorted."""
    return sorted(data.load_table(path, "models.json"))


def load_model(name: str, path: str | Path | None = None) -> ModelConfig:
    """The model ``name`` of ``commlab/data/models.json``.

    Raises:
        KeyError: unknown name (lists the known ones).
        ValueError: a malformed entry (names the model and the field).
    """
    table = data.load_table(path, "models.json")
    if name not in table:
        raise KeyError(f"no model {name!r}; known models: {sorted(table)}")
    entry = dict(table[name])
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
    unknown = set(entry) - fields
    if unknown:
        raise ValueError(f"model {name!r}: unknown fields {sorted(unknown)}; allowed: {sorted(fields)}")
    return ModelConfig(name=name, **entry)


# ----------------------------------------------------------------------------------------- parameters

def layer_params(m: ModelConfig) -> int:
    """Parameters of one transformer layer: attention ``2h² + 2h·kv``, MLP two (gated three) ``h × ffn``, plus biases
    and two LayerNorms (``bias``) or two RMSNorm weights. GPT: ``12h² + 13h`` (Narayanan et al. 2021, Eq. 2)."""
    h, f = m.hidden, m.ffn
    kv = m.kv_heads * (h // m.heads)
    attn = 2 * h * h + 2 * h * kv
    mlp = (3 if m.gated_ffn else 2) * h * f
    if m.bias:
        extra = (h + 2 * kv) + h + ((2 * f) if m.gated_ffn else f) + h + 4 * h
    else:
        extra = 2 * h
    return attn + mlp + extra


def embedding_params(m: ModelConfig) -> int:
    """Parameters of the token embedding (and learned positions, if the model has them)."""
    return m.vocab * m.hidden + (m.seq * m.hidden if m.learned_positions else 0)


def _head_params(m: ModelConfig) -> int:
    """Final norm plus an untied output layer."""
    norm = 2 * m.hidden if m.bias else m.hidden
    return norm + (0 if m.tied_embeddings else m.vocab * m.hidden)


def parameter_count(m: ModelConfig) -> int:
    """All parameters: ``L·layer + V·h (+ s·h learned positions) + final norm (+ V·h untied output layer)``."""
    return m.layers * layer_params(m) + embedding_params(m) + _head_params(m)


def stage_layers(layers: int, pp: int, interleave: int = 1) -> int:
    """Layers on the heaviest pipeline stage: ``ceil(L/(pp·v))·v``.

    Raises:
        ValueError: a count not an int >= 1, or ``pp·v > L``.
    """
    for name, v in (("layers", layers), ("pp", pp), ("interleave", interleave)):
        checks.integer(name, v)
    if pp * interleave > layers:
        raise ValueError(f"pp·interleave = {pp}·{interleave} exceeds the {layers} layers: some pipeline chunk "
                         "would hold no layer")
    return math.ceil(layers / (pp * interleave)) * interleave


def stage_params(m: ModelConfig, pp: int, stage: str, interleave: int = 1) -> int:
    """Parameters of pipeline stage ``"first"``, ``"last"`` or ``"only"`` (pp = 1), before tp: its layers, the
    embedding on the first, the final norm and output layer on the last (with tied embeddings its own copy).

    Raises:
        ValueError: an unknown stage, or ``"only"`` with ``pp > 1``.
    """
    layers = stage_layers(m.layers, pp, interleave) * layer_params(m)
    if stage == "only" or pp == 1:
        if pp != 1:
            raise ValueError("stage 'only' needs pp == 1")
        return layers + embedding_params(m) + _head_params(m)
    if stage == "first":
        return layers + embedding_params(m)
    if stage == "last":
        return layers + _head_params(m) + (m.vocab * m.hidden if m.tied_embeddings else 0)
    raise ValueError(f"stage must be 'first', 'last' or 'only', got {stage!r}")


# ----------------------------------------------------------------------------------------- activations

def _ffn_mult(m: ModelConfig) -> float:
    return m.ffn / (4 * m.hidden) * (1.5 if m.gated_ffn else 1.0)


def activation_bytes_per_layer(m: ModelConfig, micro_batch: int, tp: int = 1, sequence_parallel: bool = True,
                               recompute: bool | str = False, flash_attention: bool = True) -> float:
    """Bytes of activations one layer keeps for the backward, per micro-batch (Korthikanti et al. 2022, §4-5):
    ``s·b·h·(34 + 5·a·s/h)``, split as their Table 2 by TP and sequence parallelism; ``2·s·b·h`` (``/t`` with
    SP) under full recomputation; ``"selective"`` and FlashAttention drop the ``5·a·s/h`` term. The MLP's 16 is
    scaled by ffn/(4h) (1.5× gated); K and V are counted for every head, and two dropout masks (high by about a
    sixth for Llama 3 405B, book §11.6). ``"every-k"`` is priced by :func:`memory_breakdown`.

    Raises:
        ValueError: micro_batch or tp not an int >= 1; a policy this function does not price.
    """
    checks.integer("micro_batch", micro_batch)
    checks.integer("tp", tp)
    policy = check_recompute_policy(recompute)
    if policy == "every-k":
        raise ValueError("activation_bytes_per_layer prices one layer: pass 'full' or 'none' for each layer of "
                         "an 'every-k' policy (memory_breakdown does)")
    s, b, h, a = m.seq, micro_batch, m.hidden, m.heads
    sbh = s * b * h
    if policy == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    mlp = 16 * _ffn_mult(m)
    scores = 0.0 if (flash_attention or policy == "selective") else 5 * a * s / h
    if tp == 1 or sequence_parallel:
        return sbh * (18 + mlp + scores) / tp
    return sbh * (10 + (8 + mlp) / tp + scores / tp)


def interleave_memory_factor(pp: int, interleave: int) -> float:
    """Extra activation memory of interleaved 1F1B on the first stage: ``1 + (p-1)/(p·v)`` for v > 1, else 1
    (Korthikanti et al. 2022, §4.2.3; Megatron-LM ``theoretical_memory_usage.py``).

    Raises:
        ValueError: pp or interleave not an int >= 1.
    """
    checks.integer("pp", pp)
    checks.integer("interleave", interleave)
    return 1.0 + (pp - 1) / (pp * interleave) if interleave > 1 else 1.0


def model_state_bytes_per_param(option: str | OptimizerDtypes = "bf16-fp32-adam", grad_bytes: int = 4,
                                zero_stage: int = 0, dp: int = 1) -> tuple[float, float, float]:
    """``(weights, gradients, optimizer states)`` bytes per parameter on one GPU; ZeRO stage 1 divides the states by
    dp, 2 the gradients too, 3 the weights too (Rajbhandari et al. 2020, §5). Sum: Megatron-LM's
    ``dist_optimizer.md`` (18 for bf16-fp32-adam with fp32 gradients).

    Raises:
        ValueError: an unknown option, grad_bytes not 2 or 4, a stage not in 0-3, dp not an int >= 1.
    """
    o = optimizer_dtypes(option)
    checks.one_of("grad_bytes", grad_bytes, (2, 4), note="bf16 or fp32")
    check_zero_stage(zero_stage)
    checks.integer("dp", dp)
    return (o.param_bytes / (dp if zero_stage >= 3 else 1), grad_bytes / (dp if zero_stage >= 2 else 1),
            o.state_bytes / (dp if zero_stage >= 1 else 1))


def usable_memory_bytes(device_memory_bytes: float, memory_reserve: float = DEFAULT_MEMORY_RESERVE) -> float:
    """Bytes a plan may use: ``(1 - memory_reserve) × device_memory_bytes``.

    Raises:
        ValueError: ``device_memory_bytes <= 0`` or ``memory_reserve`` not in [0, 1).
    """
    if not device_memory_bytes > 0:
        raise ValueError(f"device_memory_bytes must be > 0, got {device_memory_bytes!r}")
    checks.share("memory_reserve", memory_reserve, one=False, note="of device memory; 0.1 keeps 10 % free")
    return (1.0 - memory_reserve) * device_memory_bytes


def is_fragile(total_bytes: float, usable_bytes: float, margin: float = DEFAULT_FRAGILE_MARGIN) -> bool:
    """Whether ``total_bytes > (1 - margin) × usable_bytes``: it fits, but a few per cent more would not.

    Raises:
        ValueError: ``usable_bytes <= 0`` or ``margin`` not in [0, 1).
    """
    if not usable_bytes > 0:
        raise ValueError(f"usable_bytes must be > 0, got {usable_bytes!r}")
    checks.share("fragile margin", margin, one=False, note="of the usable memory")
    return total_bytes > (1.0 - margin) * usable_bytes


def memory_breakdown(m: ModelConfig, layout: Layout, global_batch: int | None = None,
                     grad_bytes: int = 2, optimizer_state_bytes: float = ADAM_STATE_BYTES_PER_PARAM,
                     optimizer: str | OptimizerDtypes | None = None) -> MemoryBreakdown:
    """Bytes per GPU of ``layout`` for model ``m``, on the stage that needs the most (first or last).

    Activations as :func:`activation_bytes_per_layer` for ``min(pp, m)`` micro-batches in flight (``m`` from
    ``global_batch``; None: m >= pp), the last stage adding the fp32 logits ``4·s·b·V/t`` (left out: the token
    ids and embedding dropout mask, under 1 %). ``optimizer``: an :data:`~.software.OPTIMIZER_DTYPES` key
    setting parameter and state bytes (None: 2-byte parameters and ``optimizer_state_bytes``); ``grad_bytes``:
    2 or 4. ZeRO-3 adds two gathered layers' bf16 weights and one layer's transient gradients.

    Raises:
        ValueError: ``grad_bytes`` not 2 or 4; ``optimizer_state_bytes <= 0``; an unknown ``optimizer``;
            ``global_batch`` not a multiple of ``dp·micro_batch``.
    """
    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (bf16) or 4 (fp32), got {grad_bytes!r}")
    if optimizer is not None:
        opt_dtypes = optimizer_dtypes(optimizer)
        param_bytes, state_bytes = opt_dtypes.param_bytes, opt_dtypes.state_bytes
    else:
        if not optimizer_state_bytes > 0:
            raise ValueError(f"optimizer_state_bytes must be > 0, got {optimizer_state_bytes!r}")
        param_bytes, state_bytes = 2, optimizer_state_bytes
    L = layout
    if global_batch is not None:
        checks.integer("global_batch", global_batch)
        if global_batch % (L.dp * L.micro_batch):
            raise ValueError(f"global_batch={global_batch} is not a multiple of dp·micro_batch = "
                             f"{L.dp}·{L.micro_batch}")
        n_micro = global_batch // (L.dp * L.micro_batch)
    else:
        n_micro = L.pp
    layers = stage_layers(m.layers, L.pp, L.interleave)
    kept = activation_bytes_per_layer(m, L.micro_batch, L.tp, L.sequence_parallel, "none", L.flash_attention)
    if L.recompute == "every-k":  # one layer in every k keeps only its input, the others keep everything
        recomputed = layers // L.recompute_every
        inputs_only = activation_bytes_per_layer(m, L.micro_batch, L.tp, L.sequence_parallel, "full")
        per_layer = (recomputed * inputs_only + (layers - recomputed) * kept) / layers
    else:
        recomputed = layers if L.recompute == "full" else 0
        per_layer = activation_bytes_per_layer(m, L.micro_batch, L.tp, L.sequence_parallel, L.recompute,
                                               L.flash_attention)
    working = 0.0
    if recomputed:  # one layer is recomputed at a time and needs its full activations meanwhile
        working = kept
    interleave_factor = interleave_memory_factor(L.pp, L.interleave)
    logits = 4 * m.seq * L.micro_batch * m.vocab / L.tp
    z = L.zero_stage
    shard = {k: (L.shard_ranks if z >= s else 1) for k, s in (("opt", 1), ("grad", 2), ("param", 3))}
    # ZeRO-3 gathers whole layers: two layers' bf16 weights at once (the one running and the one prefetched; an
    # assumption about the prefetch depth), and one layer's unsharded gradients in the parameter dtype beside
    # the ReduceScatter input it copies them into, in the reduce dtype (FSDP2 foreach_reduce).
    gathered = layer_params(m) / L.tp if z >= 3 and L.shard_ranks > 1 else 0.0

    def build(stage: str, in_flight: float, extra_act: float) -> MemoryBreakdown:
        p = stage_params(m, L.pp, stage, L.interleave) / L.tp
        return MemoryBreakdown(params=p, weights_bytes=param_bytes * p / shard["param"] + 2 * 2 * gathered,
                               gradients_bytes=grad_bytes * p / shard["grad"] + (param_bytes + grad_bytes) * gathered,
                               optimizer_bytes=state_bytes * p / shard["opt"],
                               activations_bytes=layers * per_layer * in_flight + working + extra_act,
                               in_flight=in_flight, stage=stage)

    if L.pp == 1:
        return build("only", 1.0, logits)
    first = build("first", min(L.pp, n_micro) * interleave_factor, 0.0)
    last = build("last", 1.0, logits)
    return first if first.total_bytes >= last.total_bytes else last
