"""Suite (b): DP modes against non-private training under FSDP on several GPUs, across sequence lengths.

    python scripts/dp/run_fsdp_suite.py --nproc 2 [--tokens "1024 2304 4096"] [--batch-sizes 16]
        [--modes "no_dp ghost flash flash_bookkeeping"] [--output-dir outputs/dp_fsdp_suite] [train.py flags ...]
    python scripts/dp/run_fsdp_suite.py --model llama3 --nproc 8 [--flavor Llama-3.1-8B] [--tokens "1024 2048 4096"]
        [--batch-sizes 2] [--output-dir outputs/dp_fsdp_suite_llama3] [train.py flags ...]

Every (tokens, batch, mode) is one torchrun of train.py over --nproc processes with FSDP (shard degree
nproc). "no_dp" is non-private training (--dp.enable false) with the same settings. --nproc 1 runs FSDP2 on a
one-rank mesh (--parallelism.fsdp_single_device true: bf16 compute on fp32 master weights, nothing sharded), what
one GPU allows of the suite.

--model dit (the default): DiT-L/8 (train_configs/dit_l8_pixel_dp.toml); token counts set the input size: with
patch 8, 1024, 2304 and 4096 tokens are 256, 384 and 512 pixels a side; 16 images per GPU.

--model llama3: the Llama 3 suite of our origin document: --flavor (Llama-3.1-8B) as a sequence classifier
(--model.num_classes 2, untied: DP refuses a tied LM head) on synthetic tokens (--training.dataset
synthetic_classification), 2 sequences per GPU, token counts are the sequence lengths (training.seq_len 1024, 2048,
4096). The runs start from train_configs/llama3_1b.toml (bf16, AdamW, no EMA), eager (--compile.enable false, as
the DiT suite compares eager steps), with no activation checkpointing; train.py flags given here come last and win
(e.g. --compile.enable true).

Each run writes its folder under <output dir>/runs/<mode>_t<tokens>_bs<B>/, and the suite writes
<output dir>/<mode>_t<tokens>_bs<B>.json (fields in scripts/dp/common.py: step time and images/s, or tokens/s for
Llama 3, are medians over the warm steps; memory and the breakdown are rank 0's), then the plots (memory, time and
overhead against tokens) and summary.txt of scripts/dp/visualize.py. Runs already ok are kept unless --force.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.dp import common, visualize  # noqa: E402  (needs the repository root on the path)
from scripts.lib import words  # noqa: E402

MODES = ("no_dp", "ghost", "flash", "flash_bookkeeping")
# Per model: the defaults of --config, --tokens, --batch-sizes, --output-dir (and --flavor).
MODELS = {
    "dit": {"config": "train_configs/dit_l8_pixel_dp.toml", "tokens": "1024 2304 4096", "batch_sizes": "16",
            "output_dir": "outputs/dp_fsdp_suite", "flavor": None},
    "llama3": {"config": "train_configs/llama3_1b.toml", "tokens": "1024 2048 4096", "batch_sizes": "2",
               "output_dir": "outputs/dp_fsdp_suite_llama3", "flavor": "Llama-3.1-8B"},
}  # fmt: skip


def add_args(parser) -> None:
    """Suite (b)'s own options; those left unset take the defaults of --model (MODELS)."""
    parser.add_argument("--model", default="dit", choices=sorted(MODELS), help="dit: DiT-L/8; llama3: classifier")
    parser.add_argument("--flavor", default=None, help="llama3 flavor (default Llama-3.1-8B)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run, FSDP over all of them (1: a "
                        "one-rank mesh)")  # fmt: skip
    parser.add_argument("--tokens", default=None, help="tokens per sample (DiT: squares), space separated")
    parser.add_argument("--modes", default=" ".join(MODES), help="no_dp (non-private) and dp.mode values")
    parser.add_argument("--batch-sizes", default=None, help="local batch sizes, space or comma separated")
    parser.add_argument("--output-dir", default=None)
    parser.set_defaults(config=None)


def lm_flags(flavor: str) -> list[str]:
    """train.py flags of the Llama 3 suite, before the user's (which win): the classifier on synthetic tokens."""
    return ["--model.flavor", flavor, "--training.dataset", "synthetic_classification", "--model.num_classes", "2",
            "--compile.enable", "false", "--activation_checkpoint.mode", "none", "--validation.enable", "false",
            "--checkpoint.enable", "false"]  # fmt: skip


def check_lm(config: str, extra: list[str], seq_len: int) -> None:
    """Fails early, before any run, on a flag or a sequence length the Llama 3 runs cannot take."""
    from torchtitan.config_manager import parse_args
    from torchtitan.train_spec import build_model_args, get_train_spec

    try:
        cfg = parse_args(["--job.config_file", config, "--training.seq_len", str(seq_len), *extra])
        build_model_args(get_train_spec(cfg.model.name), cfg)
    except ValueError as e:
        raise SystemExit(f"the llama3 suite cannot run: {e}") from e


def plan(opts, extra: list[str]) -> tuple[list[dict], list[str]]:
    """The suite's points (knobs) and the train.py flags every run gets after its own (`common.suite_run`)."""
    defaults = MODELS[opts.model]
    for key in ("config", "tokens", "batch_sizes", "output_dir", "flavor"):
        if getattr(opts, key) is None:
            setattr(opts, key, defaults[key])
    if opts.model == "dit" and opts.flavor is not None:
        extra = ["--model.flavor", opts.flavor, *extra]
    modes = common.check_modes(words(opts.modes), "no_dp")
    tokens, batches = [int(t) for t in words(opts.tokens)], [int(b) for b in words(opts.batch_sizes)]
    if opts.model == "llama3":
        extra = [*lm_flags(opts.flavor), *extra]
        check_lm(opts.config, extra, max(tokens))
        model = {"model": "llama3", "flavor": opts.flavor}
        return [common.suite_knobs("fsdp", mode, b, None, t, opts.nproc, **model, seq_len=t) for t in tokens
                for b in batches for mode in modes], extra  # fmt: skip
    _, patch = common.model_shape(opts.config, extra)
    return [common.suite_knobs("fsdp", mode, b, common.input_size_for(t, patch), t, opts.nproc) for t in tokens
            for b in batches for mode in modes], extra  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    # 20 steps: the measured setting (docs/benchmark_log.md)
    opts, extra = common.parse_suite_args(argv, __doc__, 20, add_args)
    if opts.nproc < 1:
        raise SystemExit(f"--nproc must be at least 1 (1: FSDP2 on a one-rank mesh), got {opts.nproc}")
    points, extra = plan(opts, extra)
    what = f"{len(points)} runs over {opts.nproc} processes (FSDP)"
    if opts.model == "llama3":
        what += f", {opts.flavor} classifier on synthetic tokens"
    results = common.run_suite(points, extra, opts, what)
    if not opts.dry_run:
        visualize.finish(results, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
