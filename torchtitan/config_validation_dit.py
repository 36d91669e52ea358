"""The checks of the DiT family's keys ([diffusion], [sampling], [alignment], and a DiT's [validation]), which
`torchtitan/config_validation.py` runs with the rest: each appends one line naming the key, its value and its source
to `errors`."""

from torchtitan.errors import at, keys_in, value_of


def check_dit_validation(cfg, args, name: str, errors: list[str]) -> None:
    """A DiT's [validation]: FID (fid_num_samples > 0) and the fixed-timestep loss (loss_num_samples > 0), at least
    one of them."""
    v = cfg.validation
    if v.fid_num_samples > 0:
        _check_fid(cfg, args, name, errors)
    if v.loss_num_samples > 0:
        _check_held_out(cfg, name, errors)
    if v.fid_num_samples == 0 and v.loss_num_samples == 0:
        errors.append(f"{at(cfg, 'validation.enable')}: on {name} with "
                      f"{keys_in(cfg, 'validation.fid_num_samples', 'validation.loss_num_samples')} both 0 there is "
                      "nothing to validate")  # fmt: skip


def _check_held_out(cfg, name: str, errors: list[str]) -> None:
    """The fixed-timestep loss's held-out data: `validation.dataset_path` where the dataset holds none out itself
    (torchtitan.datasets.build_held_out_dataset), and only where it reads one; said at start."""
    from pathlib import Path

    dataset, path = cfg.training.dataset, cfg.validation.dataset_path
    loss = f"the fixed-timestep loss of {at(cfg, 'validation.loss_num_samples')} on {name}"
    if not path and dataset in ("latents", "imagefolder"):
        what = "latent shards prepared from held-out images" if dataset == "latents" else "a folder of held-out images"
        errors.append(f"{at(cfg, 'validation.dataset_path')}: {loss} needs {what}, and {at(cfg, 'training.dataset')} "
                      "holds none out; name them, or set validation.loss_num_samples = 0")  # fmt: skip
    elif path and dataset in ("digits", "dummy"):
        errors.append(f"{at(cfg, 'validation.dataset_path')}: {at(cfg, 'training.dataset')} holds out its own "
                      "data and reads no path; leave it empty")  # fmt: skip
    elif path and not Path(path).expanduser().is_dir():
        errors.append(f"{at(cfg, 'validation.dataset_path')}: no such folder; {loss} reads its held-out data there")


def _check_fid(cfg, args, name: str, errors: list[str]) -> None:
    """A DiT's [validation] is FID (torchtitan/components/validation.py): its two local files exist and its samples
    can become images, said at start rather than at the first validation thousands of steps in."""
    from pathlib import Path

    enabled = f"{at(cfg, 'validation.enable')} on {name} computes the FID of EMA samples, which needs"
    files = {"validation.fid_reference": "reference statistics (an .npz with mu/sigma, e.g. ADM's "
                                         "VIRTUAL_imagenet256_labeled.npz)",
             "validation.inception_weights": "pytorch-fid's FID Inception weights "
                                             "(pt_inception-2015-12-05-6726825d.pth)"}  # fmt: skip
    for key, what in files.items():
        path = value_of(cfg, key)
        if not path:
            errors.append(f"{at(cfg, key)}: {enabled} {what} in a local file")
        elif not Path(path).is_file():
            errors.append(f"{at(cfg, key)}: no such file; {enabled} {what}")
    if cfg.validation.fid_num_samples == 1:
        errors.append(f"{at(cfg, 'validation.fid_num_samples')}: FID needs at least 2 samples (a covariance)")
    if (cfg.training.dataset == "latents" or args.in_channels not in (1, 3)) and not cfg.latent.tokenizer:
        errors.append(f"{at(cfg, 'latent.tokenizer')}: {enabled} images, and this latent model's samples need a "
                      "[latent] tokenizer to decode them")  # fmt: skip


def check_sampler(cfg, errors: list[str]) -> None:
    """The sampler and its settings against the objective (as diffusion.check_sampler refuses them when sampling):
    else the first sample grid, steps into the run, would fail."""
    s, objective = cfg.sampling, cfg.diffusion.objective
    samplers = {"ddpm": ("default", "ddim", "ddpm"), "rectified_flow": ("default", "euler", "heun", "sde")}
    if objective in samplers and s.sampler not in samplers[objective]:
        errors.append(f"{at(cfg, 'sampling.sampler')}: diffusion.objective {objective!r} (in "
                      f"{cfg.source_of('diffusion.objective')}) samples with {list(samplers[objective])}")  # fmt: skip
    flow_only = {"sampling.guidance_low": 0.0, "sampling.guidance_high": 1.0, "sampling.timestep_shift": 1.0}
    for key, default in flow_only.items():
        if objective == "ddpm" and value_of(cfg, key) != default:
            errors.append(f"{at(cfg, key)}: rectified_flow's; diffusion.objective 'ddpm' (in "
                          f"{cfg.source_of('diffusion.objective')}) guides every step of its own grid")  # fmt: skip
    if s.guidance_low >= s.guidance_high:
        errors.append(f"{keys_in(cfg, 'sampling.guidance_low', 'sampling.guidance_high')}: {s.guidance_low} >= "
                      f"{s.guidance_high}, an empty guidance interval")  # fmt: skip
    if s.sampler == "sde" and s.timestep_shift != 1.0:
        sde = f"the 'sde' sampler (in {cfg.source_of('sampling.sampler')})"
        errors.append(f"{at(cfg, 'sampling.timestep_shift')}: the ODE samplers' ('euler', 'heun'); {sde} steps "
                      "evenly, as SiT's and REPA's")  # fmt: skip
    for key in ("sampling.steps", "validation.fid_sampling_steps"):
        if s.sampler == "sde" and value_of(cfg, key) == 1:
            errors.append(f"{at(cfg, key)}: the 'sde' sampler (in {cfg.source_of('sampling.sampler')}) takes at "
                          "least 2 (its last step is a step of its own)")  # fmt: skip


def check_alignment(cfg, errors: list[str]) -> None:
    """What `[alignment]` needs besides its own keys (the encoder's file and the depth are checked where the model's
    args read them: models/dit/__init__.py): a DiT and the clean images to encode."""
    if not cfg.alignment.enable:
        return
    if cfg.model.name != "dit":
        errors.append(f"{keys_in(cfg, 'alignment.enable', 'model.name')}: representation alignment trains DiTs")
    if cfg.alignment.features == "stored" and cfg.training.dataset not in ("latents", "dummy"):
        errors.append(f"{keys_in(cfg, 'alignment.features', 'training.dataset')}: features are stored with prepared "
                      "latents (prepare.py --store-features); training.dataset 'latents' reads them ('dummy' makes "
                      "random ones)")  # fmt: skip


def check_flow_keys(cfg, errors: list[str]) -> None:
    """The [diffusion] keys of rectified flow alone, and LightningDiT weights' flow (their transport's time)."""
    d = cfg.diffusion
    if d.objective == "ddpm":
        for key, default in (("diffusion.time_input", "1000t"), ("diffusion.cosine_loss_weight", 0.0)):
            if value_of(cfg, key) != default:
                errors.append(f"{at(cfg, key)}: rectified_flow's; diffusion.objective 'ddpm' (in "
                              f"{cfg.source_of('diffusion.objective')}) reads integer timesteps")  # fmt: skip
    flows = {"lightningdit_pt": ("1-t", "LightningDiT's weights predict velocity in its transport's time (1 is data)"),
             "repa_pt": ("t", "REPA's SiT predicts velocity in our time, read in [0, 1]")}  # fmt: skip
    if cfg.checkpoint.initial_load_format in flows:
        time_input, why = flows[cfg.checkpoint.initial_load_format]
        wanted = {"diffusion.objective": "rectified_flow", "diffusion.prediction": "velocity",
                  "diffusion.time_input": time_input}  # fmt: skip
        wrong = [f"{key} = {value!r}" for key, value in wanted.items() if value_of(cfg, key) != value]
        if wrong:
            errors.append(f"{at(cfg, 'checkpoint.initial_load_format')}: {why}; set {', '.join(wrong)}")
