"""The memory lab: what precision, fused or windowed attention and activation checkpointing cost and save, on one
small decoder LM (Llama 3 flavor "lab" on the embedded stdlib text, train_configs/llama3_lab.toml) through train.py.

Variants (each a named set of train.py overrides; every one trains the same steps at the same batch and seq_len,
so on the same token budget, and is validated once, at the end):
- fp32: float32 parameters and compute, math SDPA (the unfused reference: (B, nh, T, T) scores in memory). TF32
  matmuls are allowed on GPU (--tf32, the default): the run's environment holds TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1,
  with which torch starts at float32 matmul precision "high" (cuBLAS uses TF32 tensor cores; as
  `torch.backends.cuda.matmul.allow_tf32 = True`, with nothing changed in the trainer); --no-tf32: IEEE fp32;
- bf16: bf16 autocast, math SDPA;
- bf16_fused: bf16, SDPA restricted to flash then cuDNN (no math fallback: a run that cannot use them fails);
- bf16_window{W}: bf16, sliding-window causal attention of W tokens (FlexAttention BlockMask on GPU, the dense
  mask on CPU), for W in --windows (512 and 256);
- fp32_ac, bf16_ac, bf16_fused_ac: fp32 (TF32) math, bf16 math and bf16 fused, each with full activation
  checkpointing.

Every variant is a scripts/lib `Run` recorded by `execute` in `<output dir>/<variant>/` (config.toml, metrics.jsonl,
memory_breakdown.json, train.log, status.json ok / OOM / failed / timeout). Its row of the results:
- memory: the trainer's memory breakdown of the first --breakdown-steps steps (torchtitan/tools/memory_breakdown.py),
  read at the last recorded step (optimizer states exist): the forward peak (the most memory held during forward),
  the backward peak, the activations forward leaves for backward; and the run's peak (scripts/lib `warm_metrics`:
  on CUDA the largest memory_peak_active_gib of the warm steps, on CPU the breakdown's largest peak);
- time: the median step time and tokens/s of the warm steps (the first --skip logged steps, by default the
  breakdown's synchronizing steps and one more, hold compilation and warm-up); the epoch time, the train split's
  windows / global batch x step time;
- quality: validation loss and perplexity after the common token budget (steps x batch x seq_len);
- with --max-batch, the largest batch (scripts/lib `find_max_batch`: short probes of the variant, without breakdown
  or validation, under `max_batch/<variant>/`).

Writes `<output dir>/memory_lab.md` (the table), `memory_lab.json` (every row) and `memory_lab_memory.png`,
`memory_lab_step_time.png`, `memory_lab_perplexity.png`.

    python scripts/run_memory_lab.py [--flavor lab] [--batch 32] [--seq-len 1024] [--steps 200] [--max-batch]
        [--variants "fp32 bf16"] [--dry-run] [train.py flags ...]
"""

import argparse
import json
import shlex
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import lib  # noqa: E402  (needs the repository root on the path)

FP32 = ["--training.mixed_precision_param", "float32"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
MATH = ["--model.sdpa_backends", "math"]
FUSED = ["--model.sdpa_backends", "flash,cudnn"]  # no math fallback
AC_FULL = ["--activation_checkpoint.mode", "full"]
TF32_ENV = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}  # torch starts at float32 matmul precision "high" (TF32)
# The table: its header, then the row's key and format of each cell after variant and status.
COLUMNS = ("| variant | status | fwd peak GiB | bwd peak GiB | activations GiB | peak GiB | max batch | step ms | "
           "tokens/s | epoch s | val loss | val ppl |")  # fmt: skip
TABLE_CELLS = (("forward_peak_gib", "{:.2f}"), ("backward_peak_gib", "{:.2f}"), ("activations_gib", "{:.2f}"),
               ("peak_memory_gib", "{:.2f}"), ("max_batch", "{}"), ("step_ms", "{:.1f}"),
               ("tokens_per_second", "{:,.0f}"), ("epoch_time_s", "{:.1f}"), ("validation_loss", "{:.4f}"),
               ("validation_perplexity", "{:.3f}"))  # fmt: skip


def variants(windows: list[int]) -> dict[str, list[str]]:
    """The lab's grid, baseline first: variant name -> the train.py flags that make it (after the shared ones)."""
    grid = {"fp32": FP32 + MATH, "bf16": BF16 + MATH, "bf16_fused": BF16 + FUSED}
    grid |= {f"bf16_window{w}": BF16 + ["--model.attn_window", str(w)] for w in windows}  # FlexAttention on GPU
    grid |= {
        "fp32_ac": FP32 + MATH + AC_FULL,
        "bf16_ac": BF16 + MATH + AC_FULL,
        "bf16_fused_ac": BF16 + FUSED + AC_FULL,
    }
    return grid


def shared_flags(args, steps: int, batch: int, measured: bool) -> list[str]:
    """The flags every variant's run has. A measured run logs every step, records the memory breakdown and is
    validated once, after its last step; a finder probe does neither."""
    flags = ["--job.config_file", args.config, "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
             "--training.steps", str(steps), "--training.local_batch_size", str(batch),
             "--training.global_batch_size=-1", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
             "--metrics.enable_wandb", "false", "--checkpoint.enable", "false",
             "--compile.enable", str(args.compile).lower(), "--validation.enable", str(measured).lower()]  # fmt: skip
    if measured:
        flags += ["--validation.freq", str(steps)]
    breakdown = measured and args.breakdown_steps > 0
    flags += ["--profiling.enable_memory_breakdown", str(breakdown).lower()]
    if breakdown:
        flags += ["--profiling.memory_breakdown_steps", str(args.breakdown_steps)]
    return flags


def variant_run(name: str, overrides: list[str], args, extra: list[str], probe_batch: int = 0) -> lib.Run:
    """A variant's run: the shared flags, its overrides, then `extra` (the scripts' "$@"), last so it wins; fp32
    variants get TF32 through the environment (--tf32). A finder probe (`probe_batch`) runs --probe-steps steps."""
    steps, batch = (args.probe_steps, probe_batch) if probe_batch else (args.steps, args.batch)
    fp32 = "float32" in overrides
    env = TF32_ENV if fp32 and args.tf32 else {}
    knobs = {"variant": name, "overrides": shlex.join(overrides), "tf32": fp32 and args.tf32}
    flags = [*shared_flags(args, steps, batch, measured=not probe_batch), *overrides, *extra]
    return lib.Run(f"{name}_bs{probe_batch}" if probe_batch else name, flags, env=dict(env), knobs=knobs)


def max_batch(name: str, overrides: list[str], args, extra: list[str]) -> dict:
    """The finder's answer for a variant ({"batch": ..., ...}; batch None and "error" when a probe failed)."""
    folder = Path(args.output_dir) / "max_batch" / name
    return lib.find_max_batch(lambda b: variant_run(name, overrides, args, extra, probe_batch=b), folder,
                              args.max_batch_limit, args.timeout or None, args.force)  # fmt: skip


def train_windows(train_args: list[str]) -> int | None:
    """Windows (sequences of seq_len) in the train split the runs read: the trainer's own data loader, built from
    the same flags (None when the config does not build)."""
    from torchtitan.config_manager import parse_args
    from torchtitan.train_spec import build_model_args, get_train_spec

    try:
        cfg = parse_args(train_args)
        spec = get_train_spec(cfg.model.name)
        loader = spec.build_dataloader_fn(cfg, build_model_args(spec, cfg), 0, 1, 0, "train")
    except (ValueError, FileNotFoundError) as e:  # the runs fail the same way and say so in their train.log
        print(f"the train split could not be built ({e}): no epoch times", flush=True)
        return None
    return len(loader.dataset)


def stage_memory(records: list[dict]) -> dict:
    """GiB by stage at the last step the breakdown recorded: forward_peak_gib and backward_peak_gib (the most memory
    held during each; several micro-batches: the largest), activations_gib (held by forward's outputs and what
    autograd saved, at the end of forward) and breakdown_step, that step. {} without records."""
    steps = [r["step"] for r in records if r["stage"] == "forward"]
    if not steps:
        return {}
    last = [r for r in records if r["step"] == max(steps)]
    peak = {stage: max(r["peak"] for r in last if r["stage"] == stage) / lib.GIB for stage in ("forward", "backward")}
    activations = max(r["activations"] for r in last if r["stage"] == "forward") / lib.GIB
    return {"forward_peak_gib": peak["forward"], "backward_peak_gib": peak["backward"],
            "activations_gib": activations, "breakdown_step": max(steps)}  # fmt: skip


def summarize(run: lib.Run, run_dir: Path, skip: int, windows: int | None, found: dict | None) -> dict:
    """One row of the results, from the run folder (status.json, config.toml, metrics.jsonl, memory_breakdown.json)."""
    row = {"variant": run.knobs["variant"], "status": lib.read_status(run_dir).get("status", "not run")}
    if (run_dir / "config.toml").is_file():  # what train.py ran
        training = tomllib.loads((run_dir / "config.toml").read_text())["training"]
        batch = training["global_batch_size"] if training["global_batch_size"] > 0 else training["local_batch_size"]
        row.update(global_batch=batch, seq_len=training["seq_len"], steps=training["steps"],
                   tokens=training["steps"] * batch * training["seq_len"])  # fmt: skip
    if row["status"] == "ok":
        row.update(lib.warm_metrics(run_dir, skip))
        row.update(stage_memory(lib.breakdown_records(run_dir)))
        records = lib.read_jsonl(run_dir / "metrics.jsonl")
        row["final_loss"] = next((r["loss"] for r in reversed(records) if "loss" in r), None)
        validation = [r for r in records if "validation_loss" in r]
        if validation:
            row.update(validation_loss=validation[-1]["validation_loss"],
                       validation_perplexity=validation[-1].get("validation_perplexity"))  # fmt: skip
        if windows and row.get("step_time_s"):
            row.update(train_windows=windows, epoch_time_s=windows / row["global_batch"] * row["step_time_s"])
    if found is not None:
        row["max_batch"] = found.get("batch")
        row["max_batch_peak_memory_gib"] = found.get("peak_memory_gib")
    row.update(overrides=run.knobs["overrides"], tf32=run.knobs["tf32"], env=run.env)
    return row


def format_table(rows: list[dict]) -> str:
    """The markdown table: one line per variant; n/a where a run did not measure a value (a failed run, a column
    the device has not, --max-batch not asked)."""
    lines = [COLUMNS, "|---" * COLUMNS.count("|", 1) + "|"]
    for r in rows:
        values = {**r, "step_ms": r.get("step_time_s") and 1000 * r["step_time_s"]}
        cells = [lib.cell(values.get(key), fmt, "n/a") for key, fmt in TABLE_CELLS]
        lines.append(f"| {r['variant']} | {r['status']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(rows: list[dict], args) -> str:
    """The report's heading: the model, the common token budget, how fp32 ran, where each column comes from."""
    ran = next((r for r in rows if "tokens" in r), None)
    budget = (f"{ran['steps']} steps x batch {ran['global_batch']} x seq_len {ran['seq_len']} = {ran['tokens']:,} "
              "tokens" if ran else f"{args.steps} steps x batch {args.batch} x seq_len {args.seq_len}")  # fmt: skip
    source = next((r["peak_memory_source"] for r in rows if "peak_memory_source" in r), "n/a")
    tf32 = "TF32 matmuls (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1)" if args.tf32 else "IEEE fp32 matmuls"
    return (f"# Memory lab: Llama 3 {args.flavor!r}, {args.config}\n\n"
            f"Every variant trains {budget}, then is validated once. fp32 variants: {tf32} on GPU. "
            f"Peak memory: {source}; forward / backward peaks and activations: the memory breakdown's last "
            "recorded step. Step time: the median of the warm steps; epoch: the train split's windows / batch x "
            "step time.\n")  # fmt: skip


def plot(rows: list[dict], output_dir: Path) -> list[Path]:
    """Bar charts, one group per variant (failed variants keep their place, without bars): memory (forward peak,
    backward peak, peak), step time, validation perplexity."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    charts = {"memory": ({"forward peak": "forward_peak_gib", "backward peak": "backward_peak_gib",
                          "peak": "peak_memory_gib"}, "GiB", 1.0),
              "step_time": ({"step time": "step_time_s"}, "ms per step", 1000.0),
              "perplexity": ({"validation perplexity": "validation_perplexity"}, "perplexity", 1.0)}  # fmt: skip
    labels = [r["variant"] if r["status"] == "ok" else f"{r['variant']}\n({r['status']})" for r in rows]
    paths = []
    for name, (series, unit, scale) in charts.items():
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4.5))
        width = 0.8 / len(series)
        for i, (label, key) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j, r in enumerate(rows) if r.get(key) is not None]
            ax.bar(xs, [scale * r[key] for r in rows if r.get(key) is not None], width, label=label)
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right")
        ax.set_ylabel(unit)
        ax.set_title(f"memory lab: {name.replace('_', ' ')}")
        if len(series) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(output_dir / f"memory_lab_{name}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def parse_args(argv: list[str] | None):
    # No abbreviations: a train.py flag is never taken for one of these options.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # fmt: skip
    parser.add_argument("--config", default="train_configs/llama3_lab.toml", help="TOML every run starts from")
    parser.add_argument("--flavor", default="lab", help="Llama 3 flavor (torchtitan/models/llama3/flavors.py)")
    parser.add_argument("--batch", type=int, default=32, help="local batch of every run (one process)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence of every run")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (the common token budget)")
    parser.add_argument("--breakdown-steps", type=int, default=2, help="first steps the memory breakdown records")
    parser.add_argument("--skip", type=int, default=-1, help="logged steps left out of the medians (default: "
                        "breakdown steps + 1)")  # fmt: skip
    parser.add_argument("--windows", default="512 256", help="attn_window sizes of the sliding-window variants")
    parser.add_argument("--variants", default="", help="run only these variants (names, space or comma separated)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="allow TF32 matmuls in the fp32 variants on GPU")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="compile the blocks in every variant")
    parser.add_argument("--max-batch", action="store_true", help="also find each variant's largest batch (probes)")
    parser.add_argument("--max-batch-limit", type=int, default=1024, help="largest batch the finder tries")
    parser.add_argument("--probe-steps", type=int, default=2, help="training steps per finder probe")
    parser.add_argument("--no-plots", action="store_true", help="write no PNGs")
    parser.add_argument("--output-dir", default="outputs/memory_lab")
    args, extra = lib.parse_script_args(parser, argv)
    if args.skip < 0:
        args.skip = args.breakdown_steps + 1
    if args.steps <= args.skip:
        raise SystemExit(f"--steps {args.steps} leaves no warm step after skipping {args.skip}")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    grid = lib.select_variants(variants([int(w) for w in lib.words(args.windows)]), args.variants)
    output_dir = Path(args.output_dir)
    print(f"{len(grid)} variants of Llama 3 {args.flavor!r}, batch {args.batch} x seq_len {args.seq_len}, "
          f"{args.steps} steps each -> {output_dir}/", flush=True)  # fmt: skip
    if args.dry_run:
        for name, overrides in grid.items():
            print(f"{name}: {lib.command_line(variant_run(name, overrides, args, extra), output_dir / name)}")
        return 0
    windows = train_windows([*shared_flags(args, args.steps, args.batch, measured=True), *extra])
    rows = []
    for name, overrides in grid.items():
        run, run_dir = variant_run(name, overrides, args, extra), output_dir / name
        status = lib.execute(run, run_dir, args.timeout or None, args.force)["status"]
        found = max_batch(name, overrides, args, extra) if args.max_batch and status in ("ok", "OOM") else None
        rows.append(summarize(run, run_dir, args.skip, windows, found))
    table = format_table(rows)
    (output_dir / "memory_lab.md").write_text(f"{describe(rows, args)}\n{table}\n")
    (output_dir / "memory_lab.json").write_text(json.dumps(rows, indent=1))
    if not args.no_plots:
        plot(rows, output_dir)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
