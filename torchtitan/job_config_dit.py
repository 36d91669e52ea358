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
    """'ddim' or 'ddpm' (the ddpm objective), 'euler', 'heun' or 'sde' (rectified_flow); 'default' picks per
    objective (ddim, euler). 'ddpm' is ancestral sampling over `steps` respaced timesteps with the learned variance:
    the DiT paper's sampler (250 steps for its FIDs). 'sde' is SiT's and REPA's Euler-Maruyama sampler (the sde_*
    keys): `steps` model evaluations, the last one a deterministic step (SiT's and REPA's FIDs: 250)."""
    cfg_scale: float = 1.0
    """Classifier-free guidance scale (1: off)."""
    guidance_channels: int = -1
    """Output channels the guidance applies to, the first ones (-1: all, the standard guidance). 3 on 4-channel
    latents reproduces facebookresearch/DiT's forward_with_cfg, with which its published FIDs were sampled."""
    guidance_low: float = 0.0
    """rectified_flow: guidance only at the steps that start at a t (1: noise, 0: data; after the timestep shift)
    with guidance_low <= t <= guidance_high, the conditional model alone at the others (REPA's guidance_low and
    guidance_high: its FIDs guide below t = 0.7). LightningDiT's cfg_interval_start s is guidance_high = 1 - s."""
    guidance_high: float = 1.0
    """rectified_flow: the top of the guidance interval (see guidance_low)."""
    timestep_shift: float = 1.0
    """rectified_flow's ODE samplers ('euler', 'heun'): the time grid t_k = 1 - k / steps moved to
    t_k / (shift + (1 - shift) t_k), LightningDiT's timestep_shift (its configs: 0.3, more steps near the noise;
    SD3's shift is 1 / this). 1: none."""
    sde_diffusion_form: str = "sigma"
    """The 'sde' sampler's diffusion coefficient w(t) in dx = [v - w score] dt + sqrt(2 w) dW, SiT's names:
    'sigma' and 'linear' (norm * t: SiT's default, REPA's) or 'decreasing' ((1 - norm cos(pi t))^2 / 4)."""
    sde_diffusion_norm: float = 1.0
    """The 'sde' sampler's scale of w(t) (SiT's diffusion_norm)."""
    sde_last_step: str = "mean"
    """The 'sde' sampler's last step, from t = sde_last_step_size to 0, SiT's: 'mean' (the drift without noise;
    REPA's), 'euler' (the ODE's velocity) or 'tweedie' (to E[x0 | x_t])."""
    sde_last_step_size: float = 0.04
    """Where the 'sde' sampler's stochastic steps end and its last step starts (SiT's default and REPA's 0.04)."""
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
