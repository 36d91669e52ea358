"""Plots and a summary table of the DP suites' results (scripts/dp/run_dp_suite.py, run_fsdp_suite.py).

    python scripts/dp/visualize.py OUTPUT_DIR [OUTPUT_DIR ...] [--out FOLDER]

Reads every run's result JSON in the folders (and max_batch.json) and writes, into FOLDER (default: the
first folder):
- memory_breakdown_bars.png: per batch (and token count), one stacked bar per mode: the memory parts at
  the recorded stage where that mode's total is largest (the stage is written on the bar);
- memory_timeline.png: per run, the parts at every recorded stage in order (step:stage), stacked, and the
  peak since the previous stage;
- tradeoff.png: step time against peak memory, one point per run;
- fsdp_scaling.png and fsdp_overhead.png (FSDP suite): peak memory and step time against tokens (per image, or
  the sequence length of the Llama 3 suite), and both as ratios to no_dp;
- summary.txt: one table row per run (tokens/s for language models where DiTs have images/s), and the largest
  batch per mode when it was searched.
Whatever stages and memory parts the breakdowns hold are shown; none is assumed.
"""

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.dp.common import GIB, NON_PRIVATE, breakdown_parts  # noqa: E402  (needs the repository root)
from torchtitan.tools.memory_breakdown import stacked_bars  # noqa: E402

MODE_ORDER = ("vanilla", "no_dp", "ghost", "flash", "bookkeeping", "flash_bookkeeping")
COLUMNS = ("suite", "mode", "tokens", "batch", "nproc", "status", "peak GiB", "step ms", "images/s", "time x",
           "memory x", "DP buffers GiB", "peak stage")  # fmt: skip
# Language-model runs (knob seq_len: the FSDP suite's --model llama3) report tokens/s where a DiT reports images/s.
RATE_COLUMNS = ("images/s", "tokens/s")


def load_results(folders: list[Path]) -> tuple[list[dict], dict | None]:
    """(run results sorted by suite, tokens, batch and mode; the max_batch.json content or None)."""
    results, max_batch = [], None
    for folder in folders:
        for path in sorted(Path(folder).glob("*.json")):
            data = json.loads(path.read_text())
            if path.name == "max_batch.json":
                max_batch = data
            elif isinstance(data, dict) and "suite" in data and "mode" in data:
                results.append(data)

    def order(r: dict) -> tuple:
        rank = MODE_ORDER.index(r["mode"]) if r["mode"] in MODE_ORDER else len(MODE_ORDER)
        return r["suite"], r["tokens"], r["batch"], rank, r["mode"]

    return sorted(results, key=order), max_batch


def group_of(r: dict) -> str:
    """The runs compared side by side: same suite, batch and tokens."""
    return f"batch {r['batch']}" if r["suite"] == "dp" else f"{r['tokens']} tokens, batch {r['batch']} x {r['nproc']}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def figure_legend(fig, axes) -> None:
    """One legend for the figure with every part any panel drew (the first panel may lack some, e.g. DP buffers)."""
    entries = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    fig.legend(list(entries.values()), list(entries), fontsize=8, loc="upper right")


def plot_breakdown_bars(results: list[dict], path: Path) -> Path | None:
    """Per group, one bar per mode: the parts at the stage of largest total."""
    rows = [r for r in results if r.get("breakdown_at_peak")]
    if not rows:
        return None
    parts = breakdown_parts([r["breakdown_at_peak"] for r in rows])
    groups = list(dict.fromkeys(group_of(r) for r in rows))
    plt = _plt()
    fig, axes = plt.subplots(1, len(groups), figsize=(4 + 3.2 * len(groups), 4.8), squeeze=False)
    for ax, group in zip(axes[0], groups):
        mine = [r for r in rows if group_of(r) == group]
        records = [r["breakdown_at_peak"] for r in mine]
        stacked_bars(ax, [r["mode"] for r in mine], records, parts, GIB)
        for i, record in enumerate(records):
            ax.text(i, record["total"] / GIB, f"{record['step']}:{record['stage']}", ha="center", va="bottom",
                    fontsize=7)  # fmt: skip
        ax.set_title(group)
        ax.margins(y=0.08)
        ax.set_ylabel("GiB at the stage of peak total")
        ax.tick_params(axis="x", rotation=30)
    figure_legend(fig, axes)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(results: list[dict], path: Path) -> Path | None:
    """Per run, the parts at every recorded stage (stacked) and the peak since the previous stage."""
    rows = [r for r in results if r.get("memory_breakdown", {}).get("records")]
    if not rows:
        return None
    parts = breakdown_parts([rec for r in rows for rec in r["memory_breakdown"]["records"]])
    ncols = min(len(rows), 5)
    nrows = math.ceil(len(rows) / ncols)
    plt = _plt()
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 2, 3.8 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        records = r["memory_breakdown"]["records"]
        labels = [f"{rec['step']}:{rec['stage']}" for rec in records]
        stacked_bars(ax, labels, records, parts, GIB)
        ax.plot(labels, [rec["peak"] / GIB for rec in records], "k_", markersize=10, label="peak since previous")
        ax.set_title(f"{r['mode']}, {group_of(r)}", fontsize=9)
        ax.set_ylabel("GiB")
        ax.tick_params(axis="x", rotation=90, labelsize=6)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    figure_legend(fig, axes)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / (4.2 * ncols + 2), 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_tradeoff(results: list[dict], path: Path) -> Path | None:
    """Step time against peak memory, one point per ok run, labelled with its group."""
    rows = [r for r in results if r.get("step_time_s") and r.get("peak_memory_gib")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        mine = [r for r in rows if r["mode"] == mode]
        ax.scatter([r["peak_memory_gib"] for r in mine], [1000 * r["step_time_s"] for r in mine], label=mode,
                   color=f"C{i}", marker="os^vDP*"[i % 7])  # fmt: skip
        for r in mine:
            ax.annotate(group_of(r), (r["peak_memory_gib"], 1000 * r["step_time_s"]), fontsize=6)
    for axis, values in (("x", [r["peak_memory_gib"] for r in rows]), ("y", [r["step_time_s"] for r in rows])):
        if max(values) > 5 * min(values):  # batches far apart: ratios read better on log axes
            getattr(ax, f"set_{axis}scale")("log")
        else:
            ax.ticklabel_format(axis=axis, useOffset=False)
    ax.set_xlabel("peak memory (GiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("time / memory trade-off")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_fsdp(results: list[dict], folder: Path) -> list[Path]:
    """FSDP suite: peak memory and step time against tokens; then both as ratios to no_dp."""
    rows = [r for r in results if r["suite"] == "fsdp" and r.get("step_time_s")]
    if not rows:
        return []
    plt = _plt()
    panels = {
        "fsdp_scaling.png": (("peak_memory_gib", "peak memory (GiB, rank 0)"), ("step_time_s", "step time (s)")),
        "fsdp_overhead.png": (("memory_ratio", "peak memory / no_dp"), ("time_ratio", "step time / no_dp")),
    }
    xlabel = "tokens per image"
    if any(is_language_model(r) for r in rows):
        xlabel = "sequence length (tokens)" if all(is_language_model(r) for r in rows) else "tokens per sample"
    written = []
    for name, keys in panels.items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, (key, label) in zip(axes, keys):
            lines = dict.fromkeys((r["mode"], r["batch"], r["nproc"]) for r in rows if r.get(key) is not None)
            for mode, batch, nproc in lines:
                if key.endswith("ratio") and mode in NON_PRIVATE:
                    continue
                mine = [r for r in rows if (r["mode"], r["batch"], r["nproc"]) == (mode, batch, nproc) and r.get(key)]
                ax.plot([r["tokens"] for r in mine], [r[key] for r in mine], "o-", label=f"{mode} (bs {batch}x{nproc})")
            if key.endswith("ratio"):
                ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        written.append(folder / name)
    return written


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value * scale, spec)


def is_language_model(r: dict) -> bool:
    """Whether a result is a language model's run (its knobs hold a sequence length)."""
    return r.get("seq_len") is not None


def columns_for(results: list[dict]) -> list[str]:
    """COLUMNS, with tokens/s instead of images/s when every run is a language model's (beside it when mixed)."""
    columns = list(COLUMNS)
    if any(is_language_model(r) for r in results):
        at = columns.index("images/s")
        columns[at : at + 1] = ["tokens/s"] if all(is_language_model(r) for r in results) else list(RATE_COLUMNS)
    return columns


def peak_stage(r: dict) -> str:
    """The step:stage of the breakdown record whose allocator peak (since the record before) is the run's largest:
    where the peak happened, not always the stage that holds the largest total (the bars' `breakdown_at_peak`)."""
    records = (r.get("memory_breakdown") or {}).get("records") or []
    if not records:
        return ""
    top = max(records, key=lambda record: record.get("peak", record["total"]))
    return f"{top['step']}:{top['stage']}"


def summary_row(r: dict, columns: list[str] | tuple[str, ...] = COLUMNS) -> list[str]:
    """One table row in `columns` (COLUMNS, or `columns_for` the results)."""
    stage = peak_stage(r)
    cells = dict(zip(COLUMNS, [r["suite"], r["mode"], str(r["tokens"]), str(r["batch"]), str(r["nproc"]), r["status"],
            _fmt(r.get("peak_memory_gib"), ".3f"), _fmt(r.get("step_time_s"), ".1f", 1000),
            _fmt(r.get("images_per_second"), ".1f"), _fmt(r.get("time_ratio"), ".2f"),
            _fmt(r.get("memory_ratio"), ".2f"), _fmt(r.get("dp_buffers_peak_gib"), ".3f"), stage]))  # fmt: skip
    cells["tokens/s"] = _fmt(r.get("tokens_per_second"), ".0f")
    return [cells[c] for c in columns]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def write_summary(results: list[dict], max_batch: dict | None, path: Path) -> Path:
    """summary.txt: the runs' table (ratios against the non-private run of the same batch and tokens)."""
    text = ["DP suites: peak memory, average warm step time, and ratios to non-private training "
            "(vanilla / no_dp) at the same batch and tokens.", "",
            markdown_table(columns_for(results), [summary_row(r, columns_for(results)) for r in results])]  # fmt: skip
    if max_batch:
        rows = []
        for mode, entry in max_batch["modes"].items():
            batch = "failed: " + entry["error"] if entry.get("batch") is None else str(entry["batch"])
            batch = ">= " + batch if entry.get("lower_bound") else batch
            rows.append([mode, batch, _fmt(entry.get("peak_memory_gib"), ".2f"), _fmt(entry.get("predicted"), ".1f"),
                         str(len(entry.get("probes", [])))])  # fmt: skip
        memory = _fmt(max_batch.get("memory_gib"), ".1f") or "unknown"
        text += ["", f"Largest local batch per mode on one device ({memory} GiB; multiple of "
                 f"{max_batch['multiple_of']}, {max_batch['probe_steps']} steps per probe):", "",
                 markdown_table(["mode", "largest batch", "peak GiB", "predicted", "probes"], rows)]  # fmt: skip
    path.write_text("\n".join(text) + "\n")
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="output folders of the suites")
    parser.add_argument("--out", default="", help="where the plots and summary.txt go (default: the first folder)")
    args = parser.parse_args(argv)
    results, max_batch = load_results([Path(f) for f in args.folders])
    out = Path(args.out or args.folders[0])
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_breakdown_bars(results, out / "memory_breakdown_bars.png"),
               plot_timeline(results, out / "memory_timeline.png"), plot_tradeoff(results, out / "tradeoff.png"),
               *plot_fsdp(results, out), write_summary(results, max_batch, out / "summary.txt")]  # fmt: skip
    written = [p for p in written if p is not None]
    print(f"wrote {', '.join(str(p) for p in written)}")
    return written


def finish(results: list[dict], opts) -> None:
    """The end of a suite (run_dp_suite.py, run_fsdp_suite.py): the plots and summary.txt of its folder, then how
    many runs were not ok."""
    if not opts.no_plots:
        main([opts.output_dir])
    failed = sum(r["status"] != "ok" for r in results)
    print(f"done: {failed} run(s) not ok (recorded in their JSON and status.json)", flush=True)


if __name__ == "__main__":
    main()
