"""The DiT family's TOML sections: [diffusion], [alignment], [sampling], [latent] (JobConfig holds them; one dataclass
per section, a docstring per field, as torchtitan/job_config.py)."""

from dataclasses import dataclass


@dataclass
class Diffusion:
    objective: str = "ddpm"
    """'ddpm' (epsilon prediction, as DiT) or 'rectified_flow' (velocity, as SiT/SD3)."""
    prediction: str = "epsilon"
    """Model target: 'epsilon' for ddpm; 'velocity' or 'x' for rectified_flow. 'x': the model predicts the clean
    image and the loss is taken on the velocity it implies, (x_t - x_hat) / t, as JiT (Li & He, 2025)."""
    x_prediction_t_min: float = 0.05
    """Under prediction 'x': the floor of t in the velocity's 1 / t, in the loss and the sampler (JiT's t_eps)."""
    noise_schedule: str = "linear"
    """DDPM beta schedule: 'linear' (DiT) or 'cosine' (iDDPM)."""
    num_timesteps: int = 1000
    """DDPM training timesteps."""
    timestep_sampling: str = "uniform"
    """'uniform' or 'logit_normal' (rectified flow, SD3)."""
    logit_normal_mean: float = 0.0
    """Mean of the logit-normal timestep density."""
    logit_normal_std: float = 1.0
    """Std of the logit-normal timestep density. Mean 0, std 1 is LightningDiT's `use_lognorm` (its time runs the
    other way, which this symmetric density does not see)."""
    time_input: str = "1000t"
    """What a rectified_flow model reads as its timestep, t being ours (0 data, 1 noise): '1000t' (the DDPM range),
    't' (REPA's SiT) or '1-t' (SiT's and LightningDiT's transport: 1 is data; their model predicts data - noise, so
    its velocity is negated). Weights of those references need their own; the path, loss and samplers stay ours."""
    cosine_loss_weight: float = 0.0
    """rectified_flow: weight of LightningDiT's velocity direction term added to each sample's loss, the mean over
    positions of 1 - cos(v_hat, v) over the channels (LightningDiT: 1; 0: off)."""
    class_dropout_prob: float = 0.1
    """Probability a label is replaced by the null class (classifier-free guidance)."""


@dataclass
class Alignment:
    enable: bool = False
    """Representation alignment (REPA): the DiT's tokens after block `depth`, through a projector, are pulled
    towards a frozen encoder's features of the clean image; coefficient x the loss is added to each sample's loss
    and logged as loss/alignment. A latent run needs its latents prepared with their images (--store-images) or the
    encoder's features (--store-features; see `features`)."""
    encoder: str = "dinov2"
    """The frozen encoder: 'dinov2' (ViT-S/B/L/g-14, with or without registers; REPA's default is ViT-B/14)."""
    encoder_path: str = ""
    """Local weights of the encoder: the official DINOv2 .pth (as torch.hub reads it, e.g.
    dinov2_vitb14_pretrain.pth) or a Hugging Face Dinov2Model folder. Nothing is downloaded."""
    depth: int = 8
    """The block (1-based) whose output tokens align (REPA: 8 of SiT-XL/2's 28)."""
    projector_dim: int = 2048
    """Hidden width of the 3-layer SiLU projector (REPA: 2048)."""
    coefficient: float = 0.5
    """Weight of the alignment loss in each sample's loss (REPA's proj_coeff)."""
    stop_step: int = 0
    """Align during the first stop_step optimizer steps only (HASTE); 0: throughout. After it the encoder no
    longer runs; the projector still does, weighted 0 (about 2% of SiT-XL/2's FLOPs)."""
    features: str = "auto"
    """Where the encoder's features come from: 'auto' (the ones stored with the latents by prepare.py
    --store-features when training.dataset_path holds them, else the encoder run on the images), 'stored' (those;
    the encoder is never built: for small DiTs, where its forward costs more than the DiT's step) or 'encoder' (run on
    the images even where features are stored). Stored features of another encoder or token grid are refused."""


@dataclass
class Sampling:
    freq: int = 500
    """Steps between sample grids (one is also written at the end; 0 disables)."""
    num_samples: int = 16
    """Images in the grid (classes cycle through 0..num_classes-1)."""
    steps: int = 50
    """Sampler steps."""
    sampler: str = "default"
    """'ddim' or 'ddpm' (the ddpm objective), 'euler' or 'heun' (rectified_flow); 'default' picks per objective
    (ddim, euler). 'ddpm' is ancestral sampling over `steps` respaced timesteps with the learned variance: the DiT
    paper's sampler (250 steps for its FIDs)."""
    cfg_scale: float = 1.0
    """Classifier-free guidance scale (1: off)."""
    guidance_channels: int = -1
    """Output channels the guidance applies to, the first ones (-1: all, the standard guidance). 3 on 4-channel
    latents reproduces facebookresearch/DiT's forward_with_cfg, with which its published FIDs were sampled."""
    seed: int = 0
    """Seed of the fixed sampling noise."""


@dataclass
class Latent:
    tokenizer: str = ""
    """'' (pixel space), 'cosmos_jit' or 'diffusers'."""
    checkpoint_dir: str = ""
    """Local folder of the tokenizer."""
    scale_factor: float = 0.0
    """Latent scale (e.g. SD 0.18215); 0 uses the statistics stored with the prepared data."""
    stats_file: str = ""
    """A LightningDiT `latents_stats.pt` ({'mean', 'std'} per channel): the per-channel normalization (z - mean) / std
    applied in training and undone before decoding, in place of the statistics stored with the prepared data ('':
    those)."""
    allow_tokenizer_mismatch: bool = False
    """Go on (with a warning) when this tokenizer is not the one the prepared latents' meta.json records."""
