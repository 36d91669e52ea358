"""JobConfig: one dataclass per TOML section, a docstring per field (the help `train.py --help` prints).

Keys follow TorchTitan's TOML (v0.2.2) where a DiT has the same knob. Parsing (TOML < CLI), the resolved config's
TOML and the removed keys' messages are in config_manager.py; every check of a config in config_validation.py.
"""

import ast
import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from torchtitan.job_config_dit import Alignment, Diffusion, Latent, Sampling

__all__ = ["Alignment", "Diffusion", "JobConfig", "Latent", "Sampling"]


@dataclass
class Job:
    config_file: str = ""
    """TOML file to load; other keys on the command line override it."""
    dump_folder: str = "./outputs/debug"
    """Run folder: metrics, checkpoints, samples, TensorBoard, traces."""
    description: str = "TorchDiTan run"
    """Free text describing the run."""
    print_config: bool = False
    """Print the resolved config at start."""
    save_config_file: str = "config.toml"
    """Name of the resolved config written to the run folder ('' to skip)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch profiler traces."""
    save_traces_folder: str = "profile_traces"
    """Traces go to <dump_folder>/<this>/iteration_N."""
    profile_freq: int = 10
    """Steps between trace dumps."""
    profiler_active: int = 1
    """Steps recorded per trace."""
    profiler_warmup: int = 3
    """Warmup steps before each recorded window."""
    enable_memory_snapshot: bool = False
    """Record CUDA allocation history and dump snapshots (GPU only)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshots go to <dump_folder>/<this>/iteration_N."""
    enable_memory_breakdown: bool = False
    """Record the bytes of parameters, gradients, optimizer states, EMA, DP buffers and activations after
    init, forward, backward, the optimizer step and zero_grad of the first steps; written to the run folder
    as memory_breakdown.json and .png (torchtitan/tools/memory_breakdown.py)."""
    memory_breakdown_steps: int = 2
    """Steps the memory breakdown records (the first of this run, resumed or not)."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Steps between console/jsonl/TensorBoard/wandb logs."""
    enable_tensorboard: bool = False
    """Write TensorBoard events."""
    save_tb_folder: str = "tb"
    """TensorBoard folder inside the run folder."""
    enable_wandb: bool = False
    """Log to Weights & Biases (set WANDB_MODE=offline to stay local)."""
    disable_color_printing: bool = False
    """Plain console lines without ANSI colors."""
    save_for_all_ranks: bool = False
    """Every rank writes its own metrics (rank-suffixed); otherwise rank 0 only."""


@dataclass
class Model:
    name: str = "dit"
    """Registered TrainSpec name: 'dit' or 'llama3'."""
    flavor: str = "debug"
    """Key of the family's flavors: dit_configs ('DiT-XL/2', '0.5B', '7B', 'debug') or llama3_configs
    ('debugmodel', 'lab', 'small' ... '2.7B', 'Llama-3.2-1B', 'Llama-3.1-8B')."""
    tokenizer_path: str = "bytes"
    """Language models: 'bytes' (UTF-8 bytes + BOS/EOS, 258 ids), or a local tokenizer.json (HF tokenizers) or
    Llama 3 tokenizer.model (tiktoken), or a folder holding one."""
    converters: list[str] = field(default_factory=lambda: ["fused_norm", "fused_mlp", "fused_qkv"])
    """Converters applied before activation checkpointing and compile, in order; each swaps modules for ones with the
    same parameter names (torchtitan/kernels/converters.py). 'fused_norm': each adaLN norm with the gated residual
    add before it as one Triton kernel each way; 'fused_mlp': fc1's bias and the MLP activation as one Triton kernel
    each way (GELU in bf16/fp16: the whole MLP as cuBLASLt GEMMs with GELU in their epilogues); 'fused_qkv': qkv's
    output gradient and bias gradient in one Triton kernel; 'float8': torchao float8 Linears, options in
    [quantize.linear.float8]. The kernels run on CUDA (torch elsewhere), and fused_mlp and fused_qkv only where their
    Linears are plain and unhooked (not under DP-SGD or float8). [] trains the plain model."""
    converters_min_tokens: int = 16384
    """On CUDA the fused converters ('fused_norm', 'fused_mlp', 'fused_qkv') stand aside, with a log line, when a
    GPU's micro-batch holds fewer tokens than this (local_batch_size x patches per image): each of their calls costs
    the host about 0.3 ms in PyTorch's custom-op dispatch, and a step that small is bound by the host's launches, not
    the GPU (DiT-XL/2 on one H200 at 32 images, 8,192 tokens: 488 images/s without them, 381 with;
    docs/benchmark_log.md, 2026-11-27). 0: always apply them."""
    input_size: int = 0
    """Override: spatial input size (pixels or latent cells); 0 keeps the flavor's."""
    in_channels: int = 0
    """Override: input channels; 0 keeps the flavor's."""
    patch_size: int = 0
    """Override: patch size; 0 keeps the flavor's."""
    num_classes: int = -1
    """Override: number of classes (0: unconditional); -1 keeps the flavor's."""
    pos_embed: str | None = None
    """Override: 'rope2d' | 'sincos' | 'learned'; unset keeps the flavor's."""
    norm: str | None = None
    """Override: 'layernorm' | 'rmsnorm'; unset keeps the flavor's."""
    mlp: str | None = None
    """Override: 'gelu' | 'swiglu'; unset keeps the flavor's."""
    qk_norm: bool | None = None
    """Override: RMS-normalize queries and keys per head; unset keeps the flavor's."""
    learn_sigma: bool | None = None
    """Override: DiT's 2C-channel output (learned variance) + VLB term (ddpm only); unset keeps the flavor's."""
    attn_window: int = -1
    """Override: windowed attention over the (2w+1) x (2w+1) token neighbourhood (FlexAttention);
    0 is global attention; -1 keeps the flavor's."""
    sdpa_backends: list[str] = field(default_factory=lambda: ["cudnn", "flash", "efficient", "math"])
    """Attention kernels in priority order ('cudnn', 'flash', 'efficient', 'math'); the first that
    supports the shapes runs. cuDNN first: fastest measured on H100 at DiT head sizes (docs/benchmark_log.md)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """'AdamW' or 'SGD' (DP-SGD's own; at momentum 0 no state: 8 bytes a weight with its gradient, AdamW 16)."""
    lr: float = 1e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Weight decay (DiT uses 0): AdamW's is decoupled; SGD's adds weight_decay x weight to the gradient."""
    momentum: float = 0.0
    """SGD's momentum (0: plain SGD). AdamW's counterpart is beta1."""
    implementation: str = "fused"
    """'fused' (CUDA only; falls back to foreach on CPU), 'foreach' or 'for-loop'."""


@dataclass
class LRScheduler:
    warmup_steps: int = 0
    """Linear warmup steps."""
    decay_ratio: float = 0.0
    """Fraction of the steps spent decaying at the end (0: constant after warmup, as DiT)."""
    decay_type: str = "cosine"
    """'linear', 'cosine' or 'sqrt'."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak."""


@dataclass
class DataLoader:
    num_workers: int = 0
    """Worker processes per rank."""
    persistent_workers: bool = False
    """Keep workers alive between epochs."""
    pin_memory: bool = False
    """Pin host memory (GPU)."""
    prefetch_factor: int = 2
    """Batches prefetched per worker (when num_workers > 0)."""
    skip_unreadable_images: bool = False
    """Image folders: an image that cannot be decoded (truncated or corrupt file) is logged by name and replaced
    by the next readable one, and the count of skipped files is logged; false stops the run naming the file."""


@dataclass
class Training:
    dataset: str = "digits"
    """DiT: 'digits' (embedded) | 'dummy' | 'imagefolder' | 'cifar10' | 'latents'. Llama 3: 'stdlib' (embedded: the
    Python standard library's source) | 'text' (a folder of .txt / .jsonl) | 'synthetic_classification'."""
    dataset_path: str = ""
    """Local folder of the dataset (imagefolder, cifar10, latents, text)."""
    image_size: int = 0
    """Image size after resize/crop; 0 uses model input_size."""
    local_batch_size: int | typing.Literal["auto"] = 32
    """Micro-batch per rank per forward, or 'auto': the largest that fits the GPU (one process: probed in
    fresh processes, estimate then bisection; torchrun: the memory estimate), rounded down to divide
    global_batch_size / data-parallel degree when that is set (torchtitan/tools/batch_size_finder.py)."""
    global_batch_size: int = -1
    """Images per optimizer step over all ranks; -1 = local x data-parallel degree (no accumulation)."""
    steps: int = 1000
    """Optimizer steps."""
    max_norm: float = 1.0
    """Gradient clipping norm (0 disables); the norm is logged either way."""
    mixed_precision_param: str = "bfloat16"
    """Parameter/compute dtype on GPU ('bfloat16' or 'float32'); CPU always runs float32."""
    mixed_precision_reduce: str = "float32"
    """Gradient reduction dtype under FSDP."""
    ema_decay: float = 0.9999
    """EMA decay of weights (samples and exports use the EMA); 0 disables."""
    ema_warmup: bool = False
    """Ramp the EMA decay as min(decay, (1 + n) / (10 + n)) for short runs."""
    gc_freq: int = 50
    """Steps between Python garbage collections (0: never; automatic GC stays off either way)."""
    seq_len: int = 2048
    """Tokens per sequence (language models): packed windows of the text, or the synthetic classification length."""
    skip_memory_check: bool = False
    """Train even when the memory estimate says a rank needs more than it has (more than 1.2x the device's total
    memory, or on CPU the host's available RAM): that run is refused by default, before the model is built."""
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Validation:
    enable: bool = False
    """Every `freq` steps and at the end. Language models: the held-out loss (and perplexity) on the held-out split
    of the text datasets. DiTs: the FID (and Inception Score) of `fid_num_samples` samples of the EMA weights
    against `fid_reference`, through the Inception network of `inception_weights` (both local files; see
    docs/latent.md), and every `loss_freq` steps the loss at 8 fixed timesteps on held-out data (docs/diffusion.md)."""
    freq: int = 100
    """Steps between validations (a DiT's FID; its fixed-timestep loss runs every `loss_freq`)."""
    steps: int = 10
    """Language models: micro-batches per rank each validation reads (the same ones every time)."""
    fid_num_samples: int = 5000
    """DiTs: samples per FID, class-balanced (labels cycle through the classes), from fixed noise (`sampling.seed`),
    spread over the data-parallel ranks; 0: no FID (the fixed-timestep loss alone, which needs no files). FID is
    biased upward at small N: compare runs at the same N (the papers' figures are FID-50K)."""
    fid_reference: str = ""
    """DiTs: the reference statistics, an .npz with `mu` and `sigma` (ADM's reference batches, e.g.
    VIRTUAL_imagenet256_labeled.npz, or `scripts/evaluate_fid.py --save-stats`), or with `arr_0` images whose
    statistics are computed at start."""
    inception_weights: str = ""
    """DiTs: local file of pytorch-fid's FID Inception weights (pt_inception-2015-12-05-6726825d.pth); nothing is
    downloaded."""
    fid_dims: int = 2048
    """DiTs: Inception features, 2048 (pool3: the standard FID, and the only one with an Inception Score) or 64, 192,
    768 (cheaper blocks, for quick checks); `fid_reference` must hold statistics of as many."""
    fid_sampling_steps: int = 50
    """DiTs: sampler steps of the FID samples (`sampling.sampler`'s sampler; sample grids keep `sampling.steps`)."""
    fid_cfg_scale: float = 1.0
    """DiTs: classifier-free guidance scale of the FID samples (1: off; the DiT paper's best FID uses 1.5)."""
    fid_batch_size: int = 64
    """DiTs: samples per sampler batch and Inception batch, per rank (`sample.py --batch-size` gives the same
    samples)."""
    loss_num_samples: int = 512
    """DiTs: held-out samples of the fixed-timestep loss (`loss/val_t0` .. `loss/val_t7`, `loss/val`), each noised
    with the same noise (`sampling.seed`) at every evaluation, spread over the data-parallel ranks; a smaller
    held-out split is taken whole. 0: no fixed-timestep loss."""
    loss_freq: int = 5000
    """DiTs: steps between fixed-timestep losses (and at the end). 512 samples x 8 forwards every 5000 steps cost
    8 x 512 / (3 x global batch x 5000) of training's FLOPs: 0.11% at a global batch of 256, under 1% from 28
    (docs/diffusion.md)."""
    dataset_path: str = ""
    """DiTs: the held-out data of the fixed-timestep loss, in `training.dataset`'s format: latent shards prepared
    from held-out images ('latents', e.g. ImageNet's validation images by data/imagenet/prepare.py), a folder of
    class subfolders ('imagefolder'), or a folder holding CIFAR-10's `test_batch` ('cifar10'). Empty: CIFAR-10's
    `test_batch` beside its training batches; the digits' last 197 images, held out of training while the loss is
    on; dummy items of another pool. 'latents' and 'imagefolder' need it."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """DDP (replicate) degree; with shard > 1 gives HSDP; -1 takes the rest of the world (with shard 1: DDP over
    every rank, whatever their number)."""
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 takes the rest of the world."""
    fsdp_reshard_after_forward: str = "default"
    """'default', 'always' or 'never'."""
    fsdp_blocks_per_unit: int = 0
    """Consecutive blocks FSDP shards as one unit: one all-gather gathers the unit's parameters and one
    reduce-scatter reduces its gradients, so k blocks a unit mean k times fewer collectives and FSDP hooks, each
    k times larger, for up to k blocks' more gathered parameters at a time. 0: as many as gather in 1 GiB, at most
    half the blocks (DiT-XL/2: 14; the 7B flavor: 1)."""
    fsdp_prefetch: int = 1
    """Units whose all-gather each FSDP unit issues as it starts, in forward and in backward (explicit prefetch);
    0 leaves it to FSDP2, which all-gathers each unit when the host reaches it."""
    fsdp_single_device: bool = False
    """On one GPU, apply FSDP2 anyway (a 1-rank mesh) so compute runs on bf16 parameters with fp32
    master weights (MixedPrecisionPolicy) instead of autocast."""
    ddp_bucket_cap_mb: int = 100
    """DDP's gradient bucket size in MiB (TorchTitan's 100). Each bucket's all-reduce starts once its gradients
    exist; with the whole model compiled, dynamo also splits the graph at each bucket, so fewer, larger buckets
    mean fewer graphs for the host to launch and less of the all-reduce hidden behind the backward."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the newest complete one."""
    folder: str = "checkpoint"
    """Folder inside the run folder."""
    interval: int = 500
    """Steps between checkpoints (one is also written at the end)."""
    async_mode: str = "disabled"
    """'disabled' or 'async' (torch.distributed.checkpoint.async_save)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (0 keeps all)."""
    load_step: int = -1
    """Resume from this step instead of the newest (-1: newest)."""
    initial_load_path: str = ""
    """Checkpoint (folder or file, see initial_load_format) to start from when the run has none of its own."""
    initial_load_format: str = "dcp"
    """What initial_load_path is. 'dcp': one of our DCP checkpoints (model and EMA). 'hf': a Hugging Face model
    folder (config.json + *.safetensors, Llama 3), converted by torchtitan/models/llama3/state_dict_adapter.py; its
    config.json gives the model's norm eps, RoPE theta and scaling and max positions (the flavor's shapes are
    checked against it). 'dit_pt': a facebookresearch/DiT `.pt` file (a plain state dict, or train.py's checkpoint,
    whose EMA is taken), converted by torchtitan/models/dit/state_dict_adapter.py; needs model.pos_embed =
    'sincos' and a flavor of the file's shapes. 'repa_pt': a REPA (sihyun-yu/REPA) `.pt` (its train.py's checkpoint,
    whose EMA is taken, or a plain state dict: SiT with alignment projectors), converted by
    torchtitan/models/dit/repa_adapter.py; needs a SiT-* flavor of its shapes and its SiT's time (diffusion.time_input
    = 't'), and takes the projectors when [alignment] is enabled with their shapes. 'diffusers': a diffusers
    DiTTransformer2DModel folder (or a DiTPipeline folder holding one), converted by
    torchtitan/models/dit/diffusers_adapter.py; its config must equal the model's. 'lightningdit_pt': a
    hustvl/LightningDiT `.pt` (train.py's checkpoint, whose EMA is taken, or a state dict), converted by
    torchtitan/models/dit/lightningdit_adapter.py; needs a LightningDiT-* flavor of its shapes and its transport's time
    (diffusion.time_input = '1-t'). From 'hf', 'dit_pt', 'repa_pt', 'diffusers' and 'lightningdit_pt' the model only:
    the EMA starts at the loaded weights. The file or folder is read whenever the run starts with no checkpoint of
    its own. TorchTitan's checkpoint.initial_load_in_hf = true is read as 'hf'."""
    last_save_model_only: bool = False
    """The final checkpoint holds model and EMA only."""
    export_dtype: str = "float32"
    """dtype of the EMA safetensors export ('float32' or 'bfloat16')."""
    create_seed_checkpoint: bool = False
    """Initialize on one process, save the weights as step-0 and exit; runs of any parallelism that
    resume from it start from identical weights (TorchTitan's seed checkpoint)."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """'none' | 'full' | 'selective'."""
    selective_ac_option: str = "op"
    """'op' (per-op policy) or an integer k: checkpoint every k-th block."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile what `components` lists."""
    components: list[str] = field(default_factory=lambda: ["model"])
    """What to compile: 'model' (its blocks or the whole model, by `scope`) and 'loss' (the objective's loss from
    the model's output: DDPM's variational bound is about 40 small elementwise ops forward and as many backward,
    one eager launch each; on DiT-XL/2 it moved the step by -0.2% to +1.3% at 32, 64 and 224 images on one H200,
    docs/benchmark_log.md 2026-11-27 (e), hence not in the default)."""
    mode: str = "default"
    """torch.compile mode: 'default' or 'max-autotune-no-cudagraphs' (Triton GEMMs with fused epilogues;
    minutes of autotuning at start)."""
    scope: str = "auto"
    """What one graph holds: 'block' (each block apart; the blocks share one compiled graph, so compiling
    costs one block), 'model' (the whole model: Inductor also fuses across block boundaries, e.g. a block's
    last residual add into the next block's norm, and the host launches one graph per step instead of one per
    block, at several times the compile time; on one device or under DDP, whose graph dynamo splits at DDP's
    buckets so that their all-reduce overlaps the backward; not where FSDP shards the model, nor under DP-SGD over
    several ranks) or 'auto': 'model' on CUDA where allowed (DiT-XL/2 on one H200: as fast or faster at 32, 64
    and 224 images a step, and DP-SGD's step 1.17x the non-private one at 64 against 1.69x; DDP over 4 H200s at
    32 a GPU 1.12x each block's graph; docs/benchmark_log.md, 2026-11-27 (b and c)), 'block' otherwise."""


@dataclass
class Float8:
    """Options of the converter 'float8' (model.converters): float8 training of Linear layers through torchao."""

    recipe_name: str = "tensorwise"
    """torchao recipe: 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'."""
    filter_fqns: list[str] = field(default_factory=lambda: ["final_layer", "t_embedder", "x_embedder"])
    """Module FQN substrings left in high precision."""
    emulate: bool = False
    """Emulate float8 (CPU tests)."""


@dataclass
class Linear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: Linear = field(default_factory=Linear)


@dataclass
class DP:
    enable: bool = False
    """Train with DP-SGD (per-sample clipping + Gaussian noise)."""
    mode: str = "flash_bookkeeping"
    """'ghost' | 'flash' | 'bookkeeping' | 'flash_bookkeeping' (or 'vanilla': non-private, same path)."""
    max_grad_norm: float = 1.0
    """Per-sample clipping norm C."""
    noise_multiplier: float = 1.0
    """Noise std / C; ignored when target_epsilon > 0."""
    target_epsilon: float = 0.0
    """Calibrate noise_multiplier to reach this epsilon at the end (0: use noise_multiplier). A resume keeps the
    checkpoint's noise_multiplier, or, with training.steps or the target changed, calibrates one for the remaining
    steps over the privacy already spent (refused if the budget is spent)."""
    delta: float = 1e-5
    """Target delta."""
    accountant: str = "rdp"
    """'rdp' or 'prv' (Opacus accountants)."""
    sampling: str = "shuffle"
    """'poisson' (the accountant's assumption) or 'shuffle' (fixed-size shuffled batches)."""
    augmult: int = 1
    """Noise/timestep draws per example averaged before clipping (DPDM)."""
    continue_without_privacy: bool = False
    """With dp.enable false, resume a checkpoint written with DP-SGD on: its privacy accountant is dropped and the
    rest of the run has no privacy guarantee (a Poisson-sampled run's data order restarts). Without it such a resume
    is refused."""


@dataclass
class Debug:
    seed: int = 0
    """Global seed."""
    deterministic: bool = False
    """Deterministic algorithms (bitwise-reproducible resume on CPU)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    diffusion: Diffusion = field(default_factory=Diffusion)
    alignment: Alignment = field(default_factory=Alignment)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    sampling: Sampling = field(default_factory=Sampling)
    latent: Latent = field(default_factory=Latent)
    dp: DP = field(default_factory=DP)
    debug: Debug = field(default_factory=Debug)
    # Where each key set by parse_args came from: the TOML file's path or "the command line". Not a config
    # key: never on the command line or in config.toml; a field so that dataclasses.replace and copy keep it.
    _sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._sources = dict(self._sources)  # a copy's sources are its own

    def source_of(self, key: str) -> str:
        """Where `key` (e.g. "optimizer.lr") got its value: the TOML file, "the command line" or "the defaults".

        Raises:
            KeyError: `key` is not a config key.
        """
        if key not in _leaf_keys():
            raise KeyError(f"source_of: {key!r} is not a config key")
        return self._sources.get(key, "the defaults")

    def to_dict(self) -> dict:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in _sections(self)}


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal after each field) read from the class source."""
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = str(node.value.value)
    return docs


def _sections(cfg_or_cls) -> list[dataclasses.Field]:
    """The config's fields, without private ones (JobConfig._sources)."""
    return [f for f in dataclasses.fields(cfg_or_cls) if not f.name.startswith("_")]


@functools.cache
def _leaf_keys() -> frozenset[str]:
    return frozenset(key for key, *_ in _leaf_fields(JobConfig))


def _leaf_fields(cls: type, prefix: str = ""):
    """Yields (dotted key, field, type, owning class) for every leaf field under cls."""
    hints = typing.get_type_hints(cls)
    for f in _sections(cls):
        key = f"{prefix}{f.name}"
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            yield from _leaf_fields(ftype, key + ".")
        else:
            yield key, f, ftype, cls
