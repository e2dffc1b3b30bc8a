"""Memory per GPU of a 3D-parallel (TP × PP × DP) transformer training layout, in bytes.

The model: :class:`ModelConfig` (layers L, hidden h, heads a, ffn, vocab V, sequence s), loaded from
``commlab/data/models.json`` with :func:`load_model`; the layout: :class:`Layout` (tp, pp, dp, micro-batch b, ZeRO
stage, recomputation, interleaving, sequence parallelism). :func:`memory_breakdown` returns a
:class:`MemoryBreakdown` (weights, gradients, optimizer states, activations) for the stage that needs the most
memory; :func:`usable_memory_bytes` keeps :data:`DEFAULT_MEMORY_RESERVE` free and :func:`is_fragile` flags a plan
near the limit.

Sources: ZeRO (Rajbhandari et al. 2020, §3.1 and §5), activations (Korthikanti et al. 2022, §4-5 and Table 2),
1F1B in-flight micro-batches (Narayanan et al. 2021, §2.2.1). Book: chapter 11, §11.1 lists what is counted
and assumed; chapter 12, §12.4.
"""

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
    """A GPT-style decoder-only transformer.

    Attributes:
        name: label.
        layers: transformer layers L. hidden: model width h. heads: attention heads a.
        kv_heads: key/value heads (grouped-query attention); ``heads`` for multi-head attention.
        ffn: MLP inner width (4h for GPT-3-style models).
        gated_ffn: SwiGLU-style MLP with three ``h × ffn`` matrices instead of two.
        vocab: vocabulary size V. seq: training sequence length s (tokens).
        bias: linear layers have biases and LayerNorm has a bias (GPT); False for Llama (RMSNorm, no biases).
        learned_positions: an ``s × h`` position-embedding table (GPT); False for rotary embeddings.
        tied_embeddings: the output layer shares the input embedding matrix.
        reported_params: the parameter count the source prints (for checking), or None.
        source: where the numbers come from.

    Raises:
        ValueError: a size that is not a positive int, ``hidden`` not divisible by ``heads``, or ``heads``
            not divisible by ``kv_heads``.
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
        """Total parameters, embeddings included (see :func:`parameter_count`)."""
        return parameter_count(self)

    def with_seq(self, seq: int) -> "ModelConfig":
        """The same model trained at another sequence length (tokens)."""
        return dataclasses.replace(self, seq=seq)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a training step.

    Attributes:
        tp, pp, dp: tensor-, pipeline- and data-parallel sizes (ints >= 1); the GPUs used are tp·pp·dp.
        micro_batch: sequences per micro-batch b (>= 1).
        zero1, zero_stage: ZeRO stage 0-3 (:data:`~.software.ZERO_STAGES`; 1 shards the optimizer states over
            dp, 2 the gradients too, 3 the parameters too); ``zero1`` is the older spelling (None stage: 1 if
            ``zero1`` else 0), and is set to ``zero_stage >= 1``.
        recompute, recompute_every: a policy of :data:`~.software.RECOMPUTE_POLICIES` (``"none"``,
            ``"selective"``: attention core, Korthikanti et al. 2022 §5; ``"full"``; ``"every-k"``: one layer
            in every ``recompute_every``); ``True``/``False`` are read as ``"full"``/``"none"``.
        interleave: model chunks per GPU v of interleaved 1F1B (1 = plain; Narayanan et al. 2021, §2.2.2).
        sequence_parallel, flash_attention: Megatron sequence parallelism (Korthikanti et al. 2022 §4.2.2)
            and attention kernels that keep no s × s scores (Dao et al. 2022).
        dp_shard: HSDP: ZeRO shards over groups of ``dp_shard`` consecutive DP ranks, replicated across the
            ``dp/dp_shard`` groups (AllReduce); None: all dp ranks. Divides dp; needs ZeRO >= 1.

    Raises:
        ValueError: a size that is not an int >= 1; an unknown recompute policy or ZeRO stage (listing the
            allowed ones); ``zero1=True`` with ``zero_stage=0``; ``dp_shard`` not dividing dp, or without ZeRO.
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
    """Bytes per GPU on the stage that needs the most (``stage``: ``"first"``, ``"last"`` or ``"only"``).

    Attributes:
        params: parameters of this GPU's model shard (its stage / tp; a count, not bytes); with ZeRO-3 it
            keeps 1/dp of their bytes (1/dp_shard with HSDP).
        weights_bytes, gradients_bytes, optimizer_bytes, activations_bytes: the four parts, bytes.
        in_flight: micro-batches whose activations the stage holds at once (after the interleaving factor).
        stage: which pipeline stage this is.
    """

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
        """Whether ``total_bytes <= usable_fraction × device_memory_bytes`` (:func:`usable_memory_bytes`).

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
    """The model ``name`` of ``commlab/data/models.json`` as a :class:`ModelConfig`.

    Raises:
        KeyError: unknown name; the message lists the known ones.
        ValueError: a malformed entry (the message names the model and the field).
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
    """Parameters of one transformer layer.

    Attention: Q and output projections ``h·h`` each, K and V ``h·kv`` each with ``kv = kv_heads·h/heads``;
    MLP: two (three if gated) ``h × ffn`` matrices; with ``bias``: the biases of all of them and two
    LayerNorms with weight and bias (4h); without: two RMSNorm weights (2h). For a GPT layer this is
    ``12h² + 13h`` (Narayanan et al. 2021, Eq. 2).
    """
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
    """All parameters, embeddings included: ``L·layer + V·h (+ s·h learned positions) + final norm
    (+ V·h untied output layer)``. GPT: ``12Lh² + 13Lh + (V + s)·h + 2h`` (Eq. 2 of Narayanan et al. 2021
    without the final LayerNorm's 2h)."""
    return m.layers * layer_params(m) + embedding_params(m) + _head_params(m)


def stage_layers(layers: int, pp: int, interleave: int = 1) -> int:
    """Layers on the heaviest pipeline stage: ``ceil(L/(pp·v))·v`` (v interleaved chunks per stage; with
    uneven stages the heaviest holds the rounded-up share, as in Llama 3's pp = 16 over 126 layers).

    Raises:
        ValueError: a count that is not an int >= 1, or ``pp·v > L`` (a chunk without layers).
    """
    for name, v in (("layers", layers), ("pp", pp), ("interleave", interleave)):
        checks.integer(name, v)
    if pp * interleave > layers:
        raise ValueError(f"pp·interleave = {pp}·{interleave} exceeds the {layers} layers: some pipeline chunk "
                         "would hold no layer")
    return math.ceil(layers / (pp * interleave)) * interleave


def stage_params(m: ModelConfig, pp: int, stage: str, interleave: int = 1) -> int:
    """Parameters of one pipeline stage (not yet divided by tp): :func:`stage_layers` layers, plus the embedding on
    the first stage and final norm + output layer on the last. With tied embeddings and ``pp > 1`` the last
    stage keeps its own copy of the embedding matrix for the output layer (as Megatron-LM does).

    Args:
        stage: ``"first"``, ``"last"`` or ``"only"`` (pp = 1).

    Raises:
        ValueError: an unknown stage name, or ``"only"`` with ``pp > 1``.
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
    """Bytes of activations one layer keeps for the backward pass, per micro-batch (Korthikanti et al. 2022,
    §4): ``s·b·h·(34 + 5·a·s/h)`` unparallelised; ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with TP;
    ``s·b·h·(34 + 5·a·s/h)/t`` with TP and sequence parallelism; ``2·s·b·h`` (``/t`` with sequence
    parallelism) with full recomputation (``recompute=True`` or ``"full"``); with ``"selective"`` (§5) the
    ``5·a·s/h`` attention-core term is not stored. Assumptions: the MLP's 16 scales by ffn/(4h) (and 1.5 for
    SwiGLU, which stores gate, up and their product); FlashAttention drops the ``5·a·s/h`` term; K and V are
    counted for every head and two dropout masks (GPT-3's count: high by about a sixth for Llama 3 405B,
    book §11.4). ``"every-k"`` is priced by :func:`memory_breakdown`, not here.

    Raises:
        ValueError: micro_batch or tp not an int >= 1; ``recompute`` not a policy this function prices.
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
    """Extra activation memory of the interleaved 1F1B schedule on the first stage: ``1 + (p-1)/(p·v)`` for
    v > 1 chunks per stage, 1 for plain 1F1B (Korthikanti et al. 2022, §4.2.3; Megatron-LM
    ``megatron/training/theoretical_memory_usage.py``, ``interleaved_schedule_memory_penalty``).

    Raises:
        ValueError: pp or interleave not an int >= 1.
    """
    checks.integer("pp", pp)
    checks.integer("interleave", interleave)
    return 1.0 + (pp - 1) / (pp * interleave) if interleave > 1 else 1.0


def model_state_bytes_per_param(option: str | OptimizerDtypes = "bf16-fp32-adam", grad_bytes: int = 4,
                                zero_stage: int = 0, dp: int = 1) -> tuple[float, float, float]:
    """``(weights, gradients, optimizer states)`` bytes per parameter on one GPU (ZeRO, Rajbhandari et al.
    2020, §5: stage 1 divides the states by dp, stage 2 the gradients too, stage 3 the weights too).

    ``sum(...)`` is the bytes-per-parameter figure of Megatron-LM's ``dist_optimizer.md``: 18 for
    ``"bf16-fp32-adam"`` with fp32 gradients, ``6 + 12/d`` at stage 1 over d ranks.

    Raises:
        ValueError: an unknown option, grad_bytes not 2 or 4, a ZeRO stage not in 0-3, dp not an int >= 1.
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
    """Whether a plan that needs ``total_bytes`` comes within ``margin`` of ``usable_bytes``:
    ``total_bytes > (1 - margin) × usable_bytes`` (it fits, but a few per cent more than counted and it
    would not).

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
    """Bytes per GPU of ``layout`` for model ``m``, on the stage that needs the most memory.

    Activations per layer as :func:`activation_bytes_per_layer`; the last stage adds the fp32 logits for the
    loss, ``4·s·b·V/t``. Layer norms are counted as split by tp like the matrices; the embedding's token ids
    and dropout mask (under 1 % in Megatron-LM's ``theoretical_memory_usage.py``) are left out.

    Args:
        m: the model. layout: the layout (its ``zero_stage`` says what is sharded over dp).
        global_batch: sequences per step; sets the number of micro-batches ``m = global_batch/(dp·b)``, which
            caps the micro-batches in flight at ``min(pp, m)``. None: assume ``m >= pp``.
        grad_bytes: bytes per gradient element, 2 (bf16) or 4 (fp32 main gradients).
        optimizer_state_bytes: bytes of optimizer state per parameter, with 2-byte parameters (default 12,
            Adam in mixed precision); used when ``optimizer`` is None.
        optimizer: an optimizer dtype option (a key of :data:`OPTIMIZER_DTYPES`, e.g. a software profile's
            ``optimizer_dtypes``): sets the parameter bytes and the state bytes together.

    Returns:
        the :class:`MemoryBreakdown` of the first or the last stage, whichever totals more.

    Raises:
        ValueError: ``grad_bytes`` not 2 or 4; ``optimizer_state_bytes <= 0``; an unknown ``optimizer``
            option (the message lists the known ones); ``global_batch`` not a multiple of ``dp·micro_batch``.
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
