"""What the scripts share: one run type, one launcher, one warm-step summary, one batch search, one results table.

The run type (`Run`), the launcher that records how a run ended (`launch`, `launch_command`: ok / OOM / failed /
timeout) and the median of warm step times (`warm_summary`) live in the package (torchtitan/tools/runs.py),
because the trainer's max-batch finder launches runs too. This package adds what only the scripts need:
- runner.py: `train_command` (python train.py or torchrun, the run folder, the run's arguments with the user's
  extras last) and `execute` (runs it through `launch_command` and tee.py, writes train.log and status.json,
  skips runs already ok), `parse_script_args` (its options, and the train.py flags passed through),
  `parallelism` (replicate/shard degrees -> "single"/"ddp"/"fsdp"/"hsdp", the trainer's names);
- summary.py: `warm_metrics`, the medians of a run folder's warm steps and its peak memory, and
  `breakdown_records`, its memory breakdown by stage;
- batch_search.py: `batch_probe`, `search` and `find_max_batch`, the package's finder over executed runs;
- lab.py: what the labs share: `select_variants` (the --variants option), `command_line` (a dry run's line,
  the run's environment first) and `cell` (a table cell, empty where nothing was measured);
- here: cases written on a command line (`parse_case`) and the table scripts/benchmark.py prints;
- ablation_grid.sh: the shell side of the ablation grids, whose variables scripts/run_ablations_*.sh set.
The ablation grids, the DP suites, the attention lab and the memory lab build their runs as `Run`s and use nothing else.
"""

import shlex

from scripts.lib.batch_search import batch_probe, device_memory_gib, find_max_batch, search
from scripts.lib.lab import cell, command_line, select_variants
from scripts.lib.runner import (
    already_done,
    execute,
    parallelism,
    parse_script_args,
    read_status,
    train_command,
    words,
    write_status,
)
from scripts.lib.summary import GIB, breakdown_records, read_jsonl, warm_metrics
from torchtitan.tools.runs import Run, RunResult, launch, launch_command, warm_summary

__all__ = ["GIB", "Run", "RunResult", "already_done", "batch_probe", "breakdown_records", "cell", "command_line",
           "device_memory_gib", "execute", "find_max_batch", "launch", "launch_command", "parallelism", "parse_case",
           "parse_script_args", "read_jsonl", "read_status", "result_table", "search", "select_variants",
           "train_command", "warm_metrics", "warm_summary", "words", "write_status"]  # fmt: skip


def parse_case(text: str, config: str, nproc: int = 1) -> Run:
    """ "NAME=train.py flags" -> a Run of that config (flags after the config file, so they win)."""
    name, _, overrides = text.partition("=")
    return Run(name or "default", ["--job.config_file", config, *shlex.split(overrides)], nproc)


def result_table(results: list[dict]) -> str:
    """A markdown table of measured runs: batch, images/s (tokens/s for language models), TFLOP/s, MFU, peak
    memory, median step time (and, where measured, the mean step time of steps run back to back)."""
    lm = any("tokens_per_second" in r for r in results)
    unit = "tokens/s" if lm else "images/s"
    # Optional columns, shown when any run measured them: (header, key, format of the value).
    optional = [("streamed ms", "streamed_step_time_s", lambda v: f"{1000 * v:.1f}"),
                ("data %", "data_time_share", lambda v: f"{100 * v:.1f}"),
                ("loader img/s per worker", "loader_images_per_second_per_worker", lambda v: f"{v:.0f}")]  # fmt: skip
    optional = [column for column in optional if any(column[1] in r for r in results)]
    header = f"| case | batch | {unit} | TFLOP/s | MFU % | peak mem GiB | step ms |"
    header += "".join(f" {name} |" for name, _, _ in optional)
    rows = [header, "|---" * header.count(" |") + "|"]
    for r in results:
        extra = "".join(f" {fmt(r[key])} |" if key in r else " |" for _, key, fmt in optional)
        if r["status"] != "ok":
            rows.append(f"| {r['name']} | | {r['status']} | | | | |" + " |" * len(optional))
            continue
        tflops = f"{r['tflops']:.1f}" if "tflops" in r else "n/a"
        mfu = f"{r['mfu']:.1f}" if "mfu" in r else "n/a"
        mem = f"{r['memory_peak_active_gib']:.1f}" if "memory_peak_active_gib" in r else "n/a"
        rate = f"{r['tokens_per_second']:,.0f}" if lm else f"{r['images_per_second']:.1f}"
        rows.append(f"| {r['name']} | {r['global_batch']} | {rate} | {tflops} | {mfu} | "
                    f"{mem} | {1000 * r['step_time_s']:.1f} |{extra}")  # fmt: skip
    return "\n".join(rows)
