"""The attention lab: one grid of attention and memory variants on one DiT, with a table of what each costs.

Variants (each a named set of train.py overrides, run at the same batch for the same number of steps):
fp32 with math attention (the baseline), bf16 with math attention, bf16 with flash attention (then cuDNN),
bf16 with windowed attention for each `--windows` size (FlexAttention block mask over the 2D token
neighbourhood), bf16 with full and per-op selective activation checkpointing, and flash + full AC,
window + full AC. Every run is train.py on dummy data, logged every step, recorded as scripts/run_ablation.py
records runs (`<output dir>/<variant>/`: config.toml, metrics.jsonl, train.log, status.json ok/OOM/failed);
`--max-batch` also asks the batch-size finder for each variant's largest batch (fresh-process probes).

Writes `<output dir>/attention_lab.md` (a table) and `attention_lab.json`: variant, status, batch, peak
memory, max batch, step time and images/s (medians over warm steps: the first `--skip` logged steps hold
compilation and warmup), final loss, from each run's metrics.jsonl.

    python scripts/run_attention_lab.py [--flavor DiT-B/2] [--batch 64] [--steps 20] [--max-batch]
        [--variants "fp32 bf16 bf16_flash"] [--dry-run] [train.py flags ...]
"""

import argparse
import json
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.optimization_analysis import summarize_metrics  # noqa: E402
from scripts.run_ablation import already_done, execute  # noqa: E402
from torchtitan.tools.batch_size_finder import ProbeFailed, find_max_local_batch_size  # noqa: E402

FP32 = ["--training.mixed_precision_param", "float32"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
MATH = ["--model.sdpa_backends", "math"]  # the unfused reference: (B, nh, T, T) scores in memory
FLASH = ["--model.sdpa_backends", "flash,cudnn"]  # no math fallback: a variant that cannot use them fails
AC_FULL = ["--activation_checkpoint.mode", "full"]
AC_SELECTIVE = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]


@dataclass
class Variant:
    """One point of the lab: a name and the train.py flags that make it (after the common ones)."""

    name: str
    overrides: list[str]
    parallelism: str = "single"  # status.json's field, as scripts/run_ablation.py writes it


def window(w: int) -> list[str]:
    return ["--model.attn_window", str(w)]


def variants(windows: list[int], combo_window: int) -> list[Variant]:
    """The lab's grid, baseline first."""
    grid = [Variant("fp32", FP32 + MATH), Variant("bf16", BF16 + MATH), Variant("bf16_flash", BF16 + FLASH)]
    grid += [Variant(f"bf16_window{w}", BF16 + window(w)) for w in windows]  # FlexAttention, whatever the SDPA order
    grid += [Variant("bf16_ac_full", BF16 + MATH + AC_FULL), Variant("bf16_ac_selective", BF16 + MATH + AC_SELECTIVE),
             Variant("bf16_flash_ac_full", BF16 + FLASH + AC_FULL),
             Variant(f"bf16_window{combo_window}_ac_full", BF16 + window(combo_window) + AC_FULL)]  # fmt: skip
    return grid


def common_args(args, with_batch: bool = True) -> list[str]:
    """train.py flags every variant shares, after the config file (the finder's probes set their own batch)."""
    flags = ["--model.flavor", args.flavor, "--training.dataset", "dummy",
             "--training.steps", str(args.steps), "--training.global_batch_size=-1", "--metrics.log_freq", "1",
             "--metrics.enable_tensorboard", "false", "--metrics.enable_wandb", "false", "--sampling.freq", "0",
             "--checkpoint.enable", "false", "--compile.enable", str(args.compile).lower()]  # fmt: skip
    return flags + (["--training.local_batch_size", str(args.batch)] if with_batch else [])


def train_command(variant: Variant, args, extra: list[str]) -> list[str]:
    """One run's command; `extra` (the scripts' "$@") comes last, so it wins."""
    run_dir = Path(args.output_dir) / variant.name
    return [sys.executable, "train.py", "--job.config_file", args.config, *common_args(args), *variant.overrides,
            "--job.dump_folder", str(run_dir), *extra]  # fmt: skip


def max_batch(variant: Variant, args, extra: list[str]) -> dict:
    """The finder's answer for a variant ({"batch": ..., ...} or {"error": ...}), kept under max_batch/."""
    found_file = Path(args.output_dir) / "max_batch" / f"{variant.name}.json"
    if found_file.is_file() and not args.force:  # the probes are the expensive part: keep their answer
        return json.loads(found_file.read_text())
    probe_dir = found_file.with_suffix("")  # the probes' own run folder
    train_args = [*common_args(args, with_batch=False), *variant.overrides, *extra, "--job.dump_folder",
                  str(probe_dir)]  # fmt: skip
    try:
        result = find_max_local_batch_size(args.config, train_args, steps=args.probe_steps, limit=args.max_batch_limit)
    except (ProbeFailed, ValueError) as e:  # a probe that fails without an OOM, or a config that does not parse
        result = {"batch": None, "error": str(e)}
    found_file.parent.mkdir(parents=True, exist_ok=True)
    found_file.write_text(json.dumps(result, indent=1))
    return result


def summarize(variant: Variant, run_dir: Path, skip: int, found: dict | None) -> dict:
    """One row of the table, from the run folder (status.json, config.toml, metrics.jsonl)."""
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").is_file() else {}
    row = {"variant": variant.name, "status": status.get("status", "not run")}
    if (run_dir / "config.toml").is_file():  # the batch train.py ran ("auto" resolved)
        row["batch"] = tomllib.loads((run_dir / "config.toml").read_text())["training"]["local_batch_size"]
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    records = [json.loads(line) for line in lines if line.strip()]
    if records and row["status"] == "ok":
        row.update(summarize_metrics(records, skip))
        row["final_loss"] = records[-1]["loss"]
    if found is not None:
        row["max_batch"] = found.get("batch")
        row["max_batch_peak_memory_gib"] = found.get("peak_memory_gib")
    row["overrides"] = shlex.join(variant.overrides)
    return row


def _cell(value, fmt: str = "{}") -> str:
    return "" if value is None else fmt.format(value)


def format_table(rows: list[dict]) -> str:
    """The markdown table: one line per variant; empty cells where a run did not measure it."""
    lines = ["| variant | status | batch | peak mem GiB | max batch | step ms | images/s | final loss |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        step = r.get("step_time_s")
        lines.append(f"| {r['variant']} | {r['status']} | {_cell(r.get('batch'))} | "
                     f"{_cell(r.get('peak_memory_gib'), '{:.2f}')} | {_cell(r.get('max_batch'))} | "
                     f"{_cell(step and 1000 * step, '{:.1f}')} | {_cell(r.get('images_per_second'), '{:.1f}')} | "
                     f"{_cell(r.get('final_loss'), '{:.4f}')} |")  # fmt: skip
    return "\n".join(lines)


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[,\s]+", text) if w]


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
    parser.add_argument("--probe-steps", type=int, default=2, help="timed steps per finder probe")
    parser.add_argument("--output-dir", default="outputs/attention_lab")
    parser.add_argument("--timeout", type=float, default=0, help="seconds per run (0: none)")
    parser.add_argument("--force", action="store_true", help="rerun variants already ok, probe again")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args, extra = parser.parse_known_args(argv)
    return args, [a for a in extra if a != "--"]


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    grid = variants([int(w) for w in _words(args.windows)], args.combo_window)
    if args.variants:
        wanted = _words(args.variants)
        unknown = sorted(set(wanted) - {v.name for v in grid})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {[v.name for v in grid]}")
        grid = [v for v in grid if v.name in wanted]
    output_dir = Path(args.output_dir)
    print(f"{len(grid)} variants of {args.flavor}, batch {args.batch}, {args.steps} steps each -> {output_dir}/")
    rows = []
    for variant in grid:
        cmd = train_command(variant, args, extra)
        if args.dry_run:
            print(f"{variant.name}: {shlex.join(cmd)}")
            continue
        run_dir = output_dir / variant.name
        if already_done(run_dir) and not args.force:
            print(f"{variant.name}: ok already, skipped (--force reruns)")
        else:
            execute(variant, cmd, run_dir, args.timeout or None)
        status = json.loads((run_dir / "status.json").read_text())["status"]
        found = max_batch(variant, args, extra) if args.max_batch and status in ("ok", "OOM") else None
        rows.append(summarize(variant, run_dir, args.skip, found))
    if args.dry_run:
        return 0
    table = format_table(rows)
    (output_dir / "attention_lab.md").write_text(f"# Attention lab: {args.flavor}, {args.config}\n\n{table}\n")
    (output_dir / "attention_lab.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
