"""The recipe schema: the typed dataclasses every recipe, profile and override is merged into
(``paralayer.config`` loads and checks them), the choices each field takes, and ConfigError.
Imports no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"
PROFILES_DIR = REPO_ROOT / "cluster" / "profiles"

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
EP_DISPATCH = ("flat", "node")  # parallel.ep_dispatch (null: node where routing is node-limited across nodes)
# swiglu: the SwiGLU activation and product; core_attn: RoPE + attention core; selective: both;
# full: whole blocks (every parallel.recompute_every-th layer); norm_up: DeepSeek-V3's (arXiv
# 2412.19437 §3.2.3, §3.3.3): every block's RMSNorm and MLA's latent norms and up-projections are
# rebuilt in backward (their outputs, and the core's q, k, v made from them, are not kept), and an
# MoE block's SwiGLU output as swiglu does ("cache the inputs of the SwiGLU operator and recompute
# its output"); on a GQA block it is the norms and the MoE SwiGLU (there is no up-projection).
# Refused with tp/cp > 1, compile, qk_norm, post_norms and Gated DeltaNet (config/validate.py)
RECOMPUTE = ("none", "swiglu", "core_attn", "selective", "full", "norm_up")
PRECISIONS = ("auto", "fp32", "bf16", "fp8")
# train.fp8.recipe: the scaling of the blocks' GEMM inputs (torchao's names; blockwise is DeepSeek-V3's
# 1x128 activation tiles and 128x128 weight blocks)
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
# torch.compile backends for train.compile: inductor generates kernels; aot_eager traces the same
# graphs (forward and backward) but runs them eagerly: CPU tests check the tracing without codegen
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
DATA_FORMATS = ("text", "jsonl", "parquet", "tokens", "indexed")
WANDB_MODES = ("offline", "online", "disabled")
ROUTERS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MLP_ACTS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU (Gemma: gelu_pytorch_tanh)
LINEAR_PROJ = ("fused", "split")  # model.linear.proj
LAYER_TYPES = ("full", "sliding", "linear")  # linear: Gated DeltaNet (model.linear)
BACKENDS = ("local", "slurm")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(Exception):
    """A bad recipe: names the field and says what would be valid."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0 = dense
    top_k: int = 2
    ffn_hidden: int = 0  # 0 = model.ffn_hidden
    aux_loss_coef: float = 0.01
    capacity_factor: Optional[float] = None  # None = dropless
    every: int = 1  # MoE on every k-th layer
    router: str = "softmax"  # softmax (Mixtral) | sigmoid (DeepSeek-V3, bias balancing)
    shared_ffn_hidden: int = 0  # 0 = no shared expert
    bias_update_rate: float = 0.001  # router=sigmoid: aux-loss-free balancing step (DeepSeek-V3 gamma)
    first_k_dense: int = 0  # layers 0 … k-1 stay dense (DeepSeek-V3: 3); the rest follow `every`
    n_group: int = 1  # experts in n_group groups: groups picked by their best two scores (DeepSeek-V3)
    topk_group: int = 1  # groups each token may route to (node-limited routing); n_group 1 = off
    routed_scaling_factor: float = 1.0  # routed experts' weights times this (DeepSeek-V3: 2.5)
    norm_topk_prob: Optional[bool] = None  # renormalise the top-k weights; None = the router's own habit
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (alpha); 0 = off
    # GPT-OSS's experts (paralayer/families/gpt_oss.py); the defaults are every other family's
    router_bias: bool = False  # a learned bias on the router's logits
    expert_bias: bool = False  # biases on each expert's gate, up and down projections
    # GPT-OSS's clamped SwiGLU: gate <= L, |up| <= L, out (up+1)*gate*sigmoid(alpha*gate); null = plain
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702  # its sigmoid gain (used only with swiglu_limit)
    shared_gate: bool = False  # the shared expert's output × sigmoid(a learned d → 1 gate) (Qwen3-Next)


@dataclass
class RopeConfig:
    """RoPE frequencies: default (plain base), linear (positions / factor: Gemma 3's global layers),
    llama3 (Llama 3.1 smoothing), yarn (YaRN, with its attention scale). Read from config.json's
    rope_scaling or rope_parameters."""
    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position: Optional[int] = None  # the pre-training context the scaling extends
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn (DeepSeek's mscale)
    mscale_all_dim: float = 0.0  # yarn (DeepSeek's mscale_all_dim)
    attention_factor: Optional[float] = None  # yarn: scale of cos/sin; None = from factor and mscale
    truncate: bool = True  # yarn: correction range floored/ceiled to whole dims (GPT-OSS: false)


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). kv_lora_rank 0 = off (plain GQA attention)."""
    q_lora_rank: Optional[int] = None  # None = a plain q projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3 §2.2): depth D extra blocks on the last stage."""
    depth: int = 0  # 0 = off, bit for bit
    loss_weight: float = 0.3  # lambda


@dataclass
class LinearConfig:
    """Gated DeltaNet layers (Qwen3-Next; paralayer/model/linear/): the layers model.layer_types
    marks "linear". k_heads 0 = none."""
    k_heads: int = 0  # query/key heads (linear_num_key_heads)
    v_heads: int = 0  # value heads, a multiple of k_heads (linear_num_value_heads)
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4  # the short causal conv before the delta rule
    chunk: int = 64  # tokens per chunk of the chunked delta rule (the result does not depend on it)
    # how Hugging Face stores the projections: fused (Qwen3-Next's in_proj_qkvz / in_proj_ba, per k-head)
    # | split (Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a). The layer computes the same;
    # export writes the family that stores them so (paralayer/families/qwen3_5/)
    proj: str = "fused"


@dataclass
class ModelConfig:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 8
    ffn_hidden: int = 688
    vocab_size: int = 256
    seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init: str = "random"  # random | hf:PATH
    init_std: float = 0.02
    head_dim: Optional[int] = None  # None = d_model // n_heads (Qwen3-0.6B: 128 with d_model 1024, 16 heads)
    qk_norm: bool = False  # an RMSNorm per head on q and k, before RoPE (Qwen3)
    rope: RopeConfig = field(default_factory=RopeConfig)  # model.rope_theta stays the base
    # sliding-window attention: a query sees itself and the window-1 tokens before it (transformers'
    # sliding_window); None = full attention on every layer
    sliding_window: Optional[int] = None
    # per layer "full" | "sliding" (transformers' layer_types); None = full_attention_every decides
    layer_types: Optional[List[str]] = None
    full_attention_every: int = 0  # with sliding_window: layer i full when (i+1) % k == 0; 0 = all sliding
    # Gemma 3's parts (paralayer/families/gemma3.py); the defaults are every other family's
    embed_scale: bool = False  # the embedding's output × sqrt(d_model), rounded to the embedding's dtype
    norm_offset: bool = False  # RMSNorm gains stored as w, scaling by (1 + w) in fp32; init w = 0
    post_norms: bool = False  # an RMSNorm on the attention's and the MLP's outputs too (4 per block)
    mlp_act: str = "silu"  # silu (SwiGLU) | gelu_tanh (GeGLU, gelu with the tanh approximation)
    query_pre_attn_scalar: Optional[float] = None  # softmax scale 1/sqrt(this); null = 1/sqrt(head_dim)
    rope_local_theta: Optional[float] = None  # sliding layers' own plain RoPE base; null = the full layers' RoPE
    # GPT-OSS's attention (paralayer/families/gpt_oss.py)
    attn_bias: bool = False  # biases on the q, k, v and o projections
    attn_sinks: bool = False  # a learned logit per head joining each query's softmax (its value 0)
    # Qwen3-Next's full layers: the output × sigmoid(a per-head gate the q projection also makes), and
    # RoPE on the first rotary_fraction of each head (partial_rotary_factor)
    attn_gate: bool = False
    rotary_fraction: float = 1.0
    linear: LinearConfig = field(default_factory=LinearConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    dp: Any = "auto"  # int or "auto"
    schedule: str = "1f1b"
    zero: int = 0
    recompute: str = "none"
    recompute_every: int = 1  # recompute=full: layers i with i % recompute_every == 0 (1 = every layer)
    sequence_parallel: Optional[bool] = None  # None = on when tp > 1
    tp_overlap: bool = False  # tp collectives decomposed into the GEMMs (needs sequence parallel)
    # dualpipev's overlapped forward-backward: ep all-to-alls and pp sends in flight while the other
    # half computes (parallel/pipeline/overlap.py); None = on under dualpipev with ep > 1
    pp_overlap: Optional[bool] = None
    pp_layout: Optional[List[int]] = None  # layers per pipeline chunk, uneven split
    # how the expert rows travel (parallel/expert_node.py): flat (one all-to-all, a row per routed
    # expert) | node (once per destination node, then fanned out inside it); None = node under
    # node-limited routing (model.moe.n_group > 1) with the ep group over several nodes, else flat
    ep_dispatch: Optional[str] = None


NONFINITE_ACTIONS = ("skip", "rollback", "stop")
SPIKE_ACTIONS = ("warn", "skip", "rollback", "stop")


@dataclass
class SpikeConfig:
    """A loss above mean + threshold_sigma·std of the last ``window`` steps (paralayer/runtime/health/stability.py)."""
    window: int = 50
    threshold_sigma: float = 0.0  # 0 = off
    action: str = "warn"  # warn | skip | rollback | stop


@dataclass
class Fp8Config:
    """train.precision=fp8: which scaling, and the blocks kept in bf16 (paralayer/model/float8.py).
    Only the blocks' linear GEMMs (attention projections, MLP, experts) run in FP8; the attention
    core, norms, router, embedding and head stay in the run's base precision."""
    recipe: str = "tensorwise"  # tensorwise | rowwise | blockwise
    bf16_first_blocks: int = 0  # the first N blocks (global layer index) keep their GEMMs in bf16
    bf16_last_blocks: int = 0  # the last N blocks likewise
    # DeepSeek-V3 §3.3.3: the MoE SwiGLU's inputs, kept for its recomputed output (parallel.recompute
    # swiglu or norm_up), stored in e4m3 with a scale per 1x128 tile (model/float8.py Fp8Tiles)
    cache_activations: bool = False
    # the precision around the FP8 GEMMs (auto: bf16 on GPUs, fp32 on CPU); --rehearse sets the
    # plan's (bf16 for a GPU plan) so that its CPU run keeps a GPU's dtypes (resolve/rules.py)
    base_precision: str = "auto"  # auto | bf16 | fp32


OPTIMIZERS = ("adamw", "muon")
#: train.muon.adjust_lr: torch.optim.Muon's LR adjustments (Moonshot's matches AdamW's update RMS)
MUON_ADJUST_LR = ("match_rms_adamw", "original")


@dataclass
class MuonConfig:
    """train.optimizer=muon: Newton-Schulz on the blocks' matrices, AdamW (train.lr, betas) for the
    rest (paralayer/optim/muon.py). ``lr`` null = train.lr (right with match_rms_adamw)."""
    lr: Optional[float] = None
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: str = "match_rms_adamw"  # match_rms_adamw (Moonshot) | original (Keller Jordan)
    # QK-clip (Kimi K2's MuonClip, paralayer/optim/qk_clip.py): after each step, the heads whose largest
    # pre-softmax logit passed tau get W_q/W_k rescaled to bring it to tau; null = off (Kimi K2: 100)
    qk_clip_tau: Optional[float] = None


@dataclass
class TrainConfig:
    global_batch: int = 8
    micro_batch: int = 1
    steps: int = 20
    tokens: Optional[float] = None  # token budget (e.g. 15.6e12): time and cost to train; None = steps × batch
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.1
    weight_decay_1d: bool = False  # true: decay 1-D params too (torchtitan); false: not (Megatron, nanoGPT, OLMo)
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8  # AdamW's eps (Megatron's adam_eps); tests/combos.py says why the suite raises it
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "auto"  # auto = fp32 on CPU, bf16 on GPU; fp8: the blocks' GEMMs in FP8 (train.fp8)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    optimizer: str = "adamw"  # adamw | muon (train.muon)
    muon: MuonConfig = field(default_factory=MuonConfig)
    compile: bool = False  # torch.compile each transformer block (and the loss without tp)
    compile_backend: str = "inductor"
    resume: str = "none"  # none | auto | PATH
    stop_at_step: Optional[int] = None
    skip_nonfinite: bool = False  # the older flag: on_nonfinite unset follows it (true = skip, false = stop)
    on_nonfinite: Optional[str] = None  # skip | rollback | stop
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    rollback_skip_margin: int = 0  # extra data batches skipped after the bad step's
    # watchdog: no step finished for this long → stacks + diagnosis; None = 3/4 of collective_timeout_s, 0 = off
    hang_timeout_s: Optional[float] = None
    log_every: int = 1
    threads: int = 0  # torch threads per rank; 0 = cores / local ranks
    collective_timeout_s: float = 120.0  # process-group timeout: a peer gone this long ends every rank
    eval_every: int = 0  # validation loss (data.valid) every N steps; 0 = never
    eval_batches: int = 1  # global batches of data.valid per eval (the same ones every time)


@dataclass
class DataConfig:
    # None = a generated offline corpus; format=indexed: a PREFIX (PREFIX.bin/.idx), a directory of
    # them, or a list of those
    path: Any = None
    format: str = "text"
    shuffle: bool = True
    tokenizer: Optional[str] = None  # None = byte-level; else a tokenizers JSON file
    text_field: str = "text"
    cache_dir: Optional[str] = None  # tokenised/packed corpora; None = ~/.cache/paralayer
    valid: Optional[str] = None  # held-out corpus (read with data.format) for train.eval_every
    # [{path: P, weight: W}, ...]: sources blended by weight (each read with data.format); [] = data.path
    blend: List[Any] = field(default_factory=list)
    valid_fraction: float = 0.0  # the last fraction of each source's sequences held out of training


@dataclass
class SlurmConfig:
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = 60
    constraint: Optional[str] = None
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    sbatch_extra: Dict[str, Any] = field(default_factory=dict)
    srun_args: List[str] = field(default_factory=list)
    setup: List[str] = field(default_factory=list)
    max_requeues: int = 3
    # restarts after a rank died (not bad input, exit 2): apart from preemption's max_requeues
    max_restarts: int = 0
    folder: Optional[str] = None  # submitit logs; default run.dir/../slurm-logs
    min_nodes: Optional[int] = None  # sbatch --nodes=MIN-nodes: a requeued job may come back on fewer (dp=auto)
    slurm_conf: Optional[str] = None  # the cluster's slurm.conf (wins over $SLURM_CONF); null = the environment's


@dataclass
class ClusterConfig:
    name: str = "local"
    backend: str = "local"
    device: str = "auto"
    nodes: int = 1
    devices_per_node: Optional[int] = None
    device_memory_gib: Optional[float] = None
    peak_tflops: Optional[float] = None  # dense bf16 peak per device
    # dense FP8 peak per device (train.precision=fp8); null: 2 × peak_tflops, the FP8/bf16 ratio of
    # Hopper and Blackwell tensor cores (NVIDIA datasheets; docs/planner.md "FP8")
    peak_fp8_tflops: Optional[float] = None
    # the share of a device that communication kernels take while they run beside compute
    # (parallel.pp_overlap's hidden all-to-alls and sends); null: GPUs 20/132 (DeepSeek-V3 gave 20
    # of the H800's 132 SMs to communication, arXiv 2412.19437 §3.2.1), CPU ranks 0 (not measured)
    comm_sm_fraction: Optional[float] = None
    intra_node_gbps: float = 10.0  # GB/s per device, inside a node
    inter_node_gbps: float = 1.0  # GB/s per device, across nodes
    memory_reserve_gib: float = 2.0  # kept free for the framework, allocator and kernels
    price_per_device_hour: Optional[float] = None  # cost of a device-hour (any currency): the plan's train_cost
    network_interface: Optional[str] = None  # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME of every task (e.g. eth0)
    # the local launcher restarts a run whose rank died (not bad input, exit 2) this many times,
    # each attempt from the newest verified checkpoint (dispatch/local.py); 0 = never
    max_restarts: int = 0
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None = run.dir/checkpoints
    every: int = 0  # 0 = never
    keep: int = 2  # the newest checkpoints that verify; 0 = all
    async_save: bool = False  # DCP async_save: the next steps run while the checkpoint is written
    timeout_s: float = 600.0  # checkpoint collectives and waits (I/O-sized, not the training timeout)


@dataclass
class RunConfig:
    dir: Optional[str] = None  # None = runs/<recipe>-<time>
    name: Optional[str] = None


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "paralayer"
    group: Optional[str] = None


@dataclass
class ProfileConfig:
    """torch.profiler traces of steps start … start+steps-1 on ``ranks`` (paralayer/metrics/profile.py)."""
    start: int = 0  # 0 = off
    steps: int = 1
    ranks: Optional[List[int]] = field(default_factory=lambda: [0])  # None = every rank
    memory: bool = False


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    straggler_pct: float = 20.0  # a rank this much slower than the median for 3 logged steps: warned
    timeline: bool = False
    progress: bool = True


@dataclass
class Config:
    recipe: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sweep: Dict[str, Any] = field(default_factory=dict)
