"""The attention lab: one grid of attention and memory variants on one DiT, with a table of what each costs.

Variants (each a named set of train.py overrides, run at the same batch for the same number of steps):
fp32 with math attention (the baseline), bf16 with math attention, bf16 with flash attention (then cuDNN),
bf16 with windowed attention for each `--windows` size (FlexAttention block mask over the 2D token
neighbourhood), bf16 with full and per-op selective activation checkpointing, and flash + full AC,
window + full AC. Every variant is a scripts/lib `Run` (train.py on dummy data, logged every step) that
scripts/lib's `execute` records (`<output dir>/<variant>/`: config.toml, metrics.jsonl, train.log,
status.json ok / OOM / failed (exit code) / timeout); `--max-batch` also asks the batch-size finder for each
variant's largest batch (scripts/lib's `find_max_batch`: probes are short runs of the variant, recorded under
`max_batch/<variant>/`, the answer in `max_batch/<variant>.json`).

Writes `<output dir>/attention_lab.md` (a table) and `attention_lab.json`: variant, status, batch, peak
memory, max batch, step time and images/s, final loss, from each run's metrics.jsonl through scripts/lib's
`warm_metrics` (medians over the warm steps: the first `--skip` logged steps hold compilation and warmup;
`warm_steps` lists the warm steps' numbers, it was their count before the scripts shared scripts/lib).

    python scripts/run_attention_lab.py [--flavor DiT-B/2] [--batch 64] [--steps 20] [--max-batch]
        [--variants "fp32 bf16 bf16_flash"] [--dry-run] [train.py flags ...]
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
MATH = ["--model.sdpa_backends", "math"]  # the unfused reference: (B, nh, T, T) scores in memory
FLASH = ["--model.sdpa_backends", "flash,cudnn"]  # no math fallback: a variant that cannot use them fails
AC_FULL = ["--activation_checkpoint.mode", "full"]
AC_SELECTIVE = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]


def window(w: int) -> list[str]:
    return ["--model.attn_window", str(w)]


def variants(windows: list[int], combo_window: int) -> dict[str, list[str]]:
    """The lab's grid, baseline first: variant name -> the train.py flags that make it (after the common ones)."""
    grid = {"fp32": FP32 + MATH, "bf16": BF16 + MATH, "bf16_flash": BF16 + FLASH}
    grid |= {f"bf16_window{w}": BF16 + window(w) for w in windows}  # FlexAttention, whatever the SDPA order
    grid |= {"bf16_ac_full": BF16 + MATH + AC_FULL, "bf16_ac_selective": BF16 + MATH + AC_SELECTIVE,
             "bf16_flash_ac_full": BF16 + FLASH + AC_FULL,
             f"bf16_window{combo_window}_ac_full": BF16 + window(combo_window) + AC_FULL}  # fmt: skip
    return grid


def variant_run(name: str, overrides: list[str], args, extra: list[str], probe_batch: int = 0) -> lib.Run:
    """A variant's run: the config, the flags every variant shares, its overrides, then `extra` (the scripts'
    "$@"), last so it wins. A finder probe (`probe_batch`) runs --probe-steps steps at that batch."""
    steps, batch = (args.probe_steps, str(probe_batch)) if probe_batch else (args.steps, args.batch)
    shared = ["--job.config_file", args.config, "--model.flavor", args.flavor, "--training.dataset", "dummy",
              "--training.steps", str(steps), "--training.local_batch_size", batch,
              "--training.global_batch_size=-1", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
              "--metrics.enable_wandb", "false", "--sampling.freq", "0", "--checkpoint.enable", "false",
              "--compile.enable", str(args.compile).lower()]  # fmt: skip
    knobs = {"variant": name, "overrides": shlex.join(overrides)}
    return lib.Run(f"{name}_bs{probe_batch}" if probe_batch else name, [*shared, *overrides, *extra], knobs=knobs)


def max_batch(name: str, overrides: list[str], args, extra: list[str]) -> dict:
    """The finder's answer for a variant ({"batch": ..., ...}; batch None and "error" when a probe failed)."""
    folder = Path(args.output_dir) / "max_batch" / name
    return lib.find_max_batch(lambda b: variant_run(name, overrides, args, extra, probe_batch=b), folder,
                              args.max_batch_limit, args.timeout or None, args.force)  # fmt: skip


def summarize(run: lib.Run, run_dir: Path, skip: int, found: dict | None) -> dict:
    """One row of the table, from the run folder (status.json, config.toml, metrics.jsonl)."""
    row = {"variant": run.knobs["variant"], "status": lib.read_status(run_dir).get("status", "not run")}
    if (run_dir / "config.toml").is_file():  # the batch train.py ran ("auto" resolved)
        row["batch"] = tomllib.loads((run_dir / "config.toml").read_text())["training"]["local_batch_size"]
    records = lib.read_jsonl(run_dir / "metrics.jsonl")
    if records and row["status"] == "ok":
        row.update(lib.warm_metrics(run_dir, skip))
        row["final_loss"] = records[-1]["loss"]
    if found is not None:
        row["max_batch"] = found.get("batch")
        row["max_batch_peak_memory_gib"] = found.get("peak_memory_gib")
    row["overrides"] = run.knobs["overrides"]
    return row


def format_table(rows: list[dict]) -> str:
    """The markdown table: one line per variant; empty cells where a run did not measure it."""
    lines = ["| variant | status | batch | peak mem GiB | max batch | step ms | images/s | final loss |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        step = r.get("step_time_s")
        lines.append(f"| {r['variant']} | {r['status']} | {lib.cell(r.get('batch'))} | "
                     f"{lib.cell(r.get('peak_memory_gib'), '{:.2f}')} | {lib.cell(r.get('max_batch'))} | "
                     f"{lib.cell(step and 1000 * step, '{:.1f}')} | {lib.cell(r.get('images_per_second'), '{:.1f}')} | "
                     f"{lib.cell(r.get('final_loss'), '{:.4f}')} |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/dit_xl2_latent256.toml", help="TOML every run starts from")
    parser.add_argument("--flavor", default="DiT-B/2", help="model flavor (the config's input size and channels)")
    parser.add_argument("--batch", default="64", help="local batch of every run (a number or 'auto')")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (logged every step)")
    parser.add_argument("--skip", type=int, default=1, help="logged steps left out of the warm medians")
    parser.add_argument("--windows", default="2 4 8", help="attn_window sizes of the window variants")
    parser.add_argument("--combo-window", type=int, default=4, help="attn_window of the window + AC variant")
    parser.add_argument("--variants", default="", help="run only these variants (names, space or comma separated)")
    parser.add_argument("--compile", action="store_true", help="compile the blocks in every variant")
    parser.add_argument("--max-batch", action="store_true", help="also find each variant's largest batch (probes)")
    parser.add_argument("--max-batch-limit", type=int, default=1024, help="largest batch the finder tries")
    parser.add_argument("--probe-steps", type=int, default=2, help="training steps per finder probe")
    parser.add_argument("--output-dir", default="outputs/attention_lab")
    return lib.parse_script_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    grid = lib.select_variants(variants([int(w) for w in lib.words(args.windows)], args.combo_window), args.variants)
    output_dir = Path(args.output_dir)
    print(f"{len(grid)} variants of {args.flavor}, batch {args.batch}, {args.steps} steps each -> {output_dir}/")
    rows = []
    for name, overrides in grid.items():
        run, run_dir = variant_run(name, overrides, args, extra), output_dir / name
        if args.dry_run:
            print(f"{name}: {lib.command_line(run, run_dir)}")
            continue
        status = lib.execute(run, run_dir, args.timeout or None, args.force)["status"]
        found = max_batch(name, overrides, args, extra) if args.max_batch and status in ("ok", "OOM") else None
        rows.append(summarize(run, run_dir, args.skip, found))
    if args.dry_run:
        return 0
    table = format_table(rows)
    (output_dir / "attention_lab.md").write_text(f"# Attention lab: {args.flavor}, {args.config}\n\n{table}\n")
    (output_dir / "attention_lab.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
