"""What each optimization knob does, from the ablation runs' folders: plots and a markdown summary.

    python scripts/optimization_analysis.py outputs/ [--out outputs/analysis] [--skip 1]

Reads every run folder under the given one (status.json with the run's knobs, config.toml, metrics.jsonl; see
scripts/run_ablation.py), keeps warm steps only (the first `--skip` logged steps hold compilation and
warmup) and summarizes each run with scripts/lib's `warm_metrics` (median step time, images/s and MFU; peak
memory the warm maximum; a run with no warm step has none), then writes into --out:
- <size>_<knob>.png for knob in compile, ac, parallelism, precision: images/s, MFU and peak memory against
  the local batch size; one thin line per setting of the other knobs, a thick line for the median of the settings
  run with every value of the knob (matched),
  x marks for runs that ran out of memory;
- summary.md: the change each knob makes (median ratio over matched pairs of runs that differ in that knob
  only, e.g. "compile: +70% images/s"), and every run in one table.
MFU and reserved memory exist only on GPUs; on CPU runs their columns stay empty.
"""

import argparse
import statistics
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.lib import parallelism, read_status, warm_metrics  # noqa: E402
from scripts.run_ablation import parse_name  # noqa: E402

KNOBS = ("compile", "ac", "parallelism", "precision")
# Per knob, the value the others are compared against.
BASELINES = {"compile": [False], "ac": ["none"], "precision": ["fp32"], "parallelism": ["ddp", "fsdp", "single"]}
METRICS = (("images_per_second", "images/s"), ("mfu", "MFU %"), ("peak_memory_gib", "peak active memory GiB"))


def knobs_from_config(config: dict) -> dict:
    """The ablation knobs of a resolved config.toml (shard degree -1 is left to status.json / the name)."""
    p, t = config.get("parallelism", {}), config.get("training", {})
    knobs = {"size": config.get("model", {}).get("flavor"), "batch": t.get("local_batch_size"),
             "precision": "fp32" if t.get("mixed_precision_param") == "float32" else "bf16",
             "ac": config.get("activation_checkpoint", {}).get("mode"),
             "compile": bool(config.get("compile", {}).get("enable"))}  # fmt: skip
    if p.get("data_parallel_shard_degree", -1) > 0:
        knobs.update(replicate=p.get("data_parallel_replicate_degree", 1), shard=p["data_parallel_shard_degree"])
    return {k: v for k, v in knobs.items() if v is not None}


def load_run(folder: Path, skip: int = 1) -> dict | None:
    """One run's knobs, status and warm metrics; None for folders that are not runs."""
    status, config_file, has_metrics = read_status(folder), folder / "config.toml", (folder / "metrics.jsonl").is_file()
    if not status and not has_metrics:
        return None
    run = {"name": folder.name, **(parse_name(folder.name) or {}), **status.get("knobs", {})}
    if config_file.is_file():  # what train.py actually ran (e.g. CPU runs are forced to fp32)
        run.update(knobs_from_config(tomllib.loads(config_file.read_text())))
    # Without the grid's status.json: a train.py run with logged steps, or one cut off before its first (unfinished).
    logged = has_metrics and (folder / "metrics.jsonl").stat().st_size > 0
    run["status"] = status.get("status", "ok" if logged else "unfinished" if has_metrics else "unknown")
    if "replicate" in run and "shard" in run:
        run["parallelism"] = parallelism(run["replicate"], run["shard"])
    if run["status"] == "ok":
        run.update(warm_metrics(folder, skip))
    return run


def load_runs(root: Path, skip: int = 1) -> list[dict]:
    runs = [load_run(folder, skip) for folder in sorted(Path(root).iterdir()) if folder.is_dir()]
    return [r for r in runs if r is not None and all(k in r for k in ("size", "batch", *KNOBS))]


def _context(run: dict, knob: str) -> tuple:
    """Everything that identifies a run except the knob under study and the batch size."""
    return tuple((k, run[k]) for k in ("size", *KNOBS) if k != knob)


def matched_pairs(runs: list[dict], knob: str, base, alt) -> list[tuple[dict, dict]]:
    """(baseline run, alternative run) pairs that differ in `knob` only (same size, batch, other knobs)."""
    index = {(_context(r, knob), r["batch"], r[knob]): r for r in runs}
    return [(index[(c, b, base)], r) for (c, b, v), r in index.items() if v == alt and (c, b, base) in index]


def knob_effects(runs: list[dict]) -> list[dict]:
    """Per size and knob, baseline -> each alternative: the median ratio of each metric over matched pairs."""
    effects = []
    for size in sorted({r["size"] for r in runs}):
        sized = [r for r in runs if r["size"] == size]
        for knob in KNOBS:
            values = {r[knob] for r in sized}
            base = next((b for b in BASELINES[knob] if b in values), None)
            for alt in sorted(values - {base}, key=str) if base is not None else []:
                pairs = matched_pairs(sized, knob, base, alt)
                ok = [(a, r) for a, r in pairs if a["status"] == "ok" and r["status"] == "ok"]
                effect = {
                    "size": size, "knob": knob, "change": f"{_label(base)} -> {_label(alt)}", "pairs": len(ok),
                    "fits_only_with": sum(a["status"] == "OOM" and r["status"] == "ok" for a, r in pairs),
                    "fits_only_without": sum(a["status"] == "ok" and r["status"] == "OOM" for a, r in pairs),
                }  # fmt: skip
                for key, _ in METRICS:
                    ratios = [r[key] / a[key] for a, r in ok if a.get(key) and r.get(key) is not None]
                    if ratios:
                        effect[key] = statistics.median(ratios) - 1.0
                effects.append(effect)
    return effects


def _label(value) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+.0f}%"


def effect_sentence(e: dict) -> str:
    """e.g. 'compile (off -> on), 0.5B: images/s +70%, peak memory -33% (12 pairs)'."""
    names = {"images_per_second": "images/s", "mfu": "MFU", "peak_memory_gib": "peak memory"}
    parts = ", ".join(f"{names[key]} {_percent(e[key])}" for key in names if key in e) or "no matched pairs"
    fits = f"fits only with it: {e['fits_only_with']}, only without: {e['fits_only_without']}"
    return f"{e['knob']} ({e['change']}), {e['size']}: {parts} ({e['pairs']} pairs); {fits}"


def plot_knob(runs: list[dict], size: str, knob: str, path: Path) -> bool:
    """images/s, MFU and peak memory against batch size, coloured by the knob's value; False if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    sized = [r for r in runs if r["size"] == size]
    values = sorted({r[knob] for r in sized}, key=str)
    panels = [(key, name) for key, name in METRICS if any(key in r for r in sized)]
    if len(values) < 2 or not panels:
        return False
    # The thick median line takes only settings of the other knobs that were run with every value of this knob:
    # a median over unmatched settings would compare, say, compiled runs with eager ones.
    contexts = [{_context(r, knob) for r in sized if r[knob] == value} for value in values]
    matched = set.intersection(*contexts) or set.union(*contexts)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, name) in zip(axes[0], panels):
        for value, color in zip(values, colors):
            chosen = [r for r in sized if r[knob] == value]
            by_context = defaultdict(list)
            for r in chosen:
                if key in r:
                    by_context[_context(r, knob)].append((r["batch"], r[key]))
            for points in by_context.values():  # one thin line per setting of the other knobs
                points.sort()
                ax.plot(*zip(*points), color=color, alpha=0.3, linewidth=1, marker=".")
            by_batch = defaultdict(list)
            for context, points in by_context.items():
                if context not in matched:
                    continue
                for batch, y in points:
                    by_batch[batch].append(y)
            if by_batch:
                batches = sorted(by_batch)
                ax.plot(batches, [statistics.median(by_batch[b]) for b in batches], color=color, linewidth=2.5,
                        marker="o", label=f"{knob} {_label(value)} (median, matched)")  # fmt: skip
            oom = sorted({r["batch"] for r in chosen if r["status"] == "OOM"})
            if oom:
                ax.plot(oom, [0] * len(oom), "x", color=color, markersize=9, label=f"{knob} {_label(value)}: OOM")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("local batch size")
        ax.set_ylabel(name)
        ax.set_title(f"{size}: {name}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _cell(run: dict, key: str, fmt: str) -> str:
    return format(run[key], fmt) if key in run else ""


def write_summary(runs: list[dict], effects: list[dict], plots: list[Path], root: Path, path: Path) -> None:
    counts = defaultdict(int)
    for r in runs:
        counts[r["status"]] += 1
    lines = [f"# Optimization analysis of {root}", "",
             f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ". "
             "Warm steps only; ratios are medians over pairs of runs that differ in one knob only.", "",
             "## What each knob changes", "",
             "| size | knob | change | pairs | images/s | MFU | peak memory | fits only with | fits only without |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in effects:
        lines.append(f"| {e['size']} | {e['knob']} | {e['change']} | {e['pairs']} | "
                     + " | ".join(_percent(e.get(key)) for key, _ in METRICS)
                     + f" | {e['fits_only_with']} | {e['fits_only_without']} |")  # fmt: skip
    lines += ["", *[f"- {effect_sentence(e)}" for e in effects], "", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    lines += ["", "## Runs", "",
              "| run | size | batch | precision | parallelism | AC | compile | status | images/s | MFU % | "
              "peak active GiB | step ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(runs, key=lambda r: (r["size"], *(str(r[k]) for k in KNOBS), r["batch"])):
        step_ms = f"{1000 * r['step_time_s']:.1f}" if "step_time_s" in r else ""
        lines.append(f"| {r['name']} | {r['size']} | {r['batch']} | {r['precision']} | {r['parallelism']} | "
                     f"{r['ac']} | {_label(r['compile'])} | {r['status']} | {_cell(r, 'images_per_second', '.1f')} | "
                     f"{_cell(r, 'mfu', '.1f')} | {_cell(r, 'peak_memory_gib', '.2f')} | {step_ms} |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def analyze(root: Path, out: Path, skip: int = 1) -> dict:
    """Reads the runs under root, writes the plots and summary.md into out; returns what it wrote."""
    runs = load_runs(root, skip)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for size in sorted({r["size"] for r in runs}):
        for knob in KNOBS:
            path = out / f"{size}_{knob}.png"
            if plot_knob(runs, size, knob, path):
                plots.append(path)
    effects = knob_effects(runs)
    write_summary(runs, effects, plots, root, out / "summary.md")
    return {"runs": runs, "effects": effects, "plots": plots, "summary": out / "summary.md"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="folder holding one folder per run (e.g. outputs/)")
    parser.add_argument("--out", default="", help="where plots and summary.md go (default: <root>/analysis)")
    parser.add_argument("--skip", type=int, default=1, help="logged steps to drop at the start of each run")
    args = parser.parse_args(argv)
    root = Path(args.root)
    result = analyze(root, Path(args.out) if args.out else root / "analysis", args.skip)
    for e in result["effects"]:
        print(effect_sentence(e))
    print(f"{len(result['runs'])} runs; wrote {len(result['plots'])} plots and {result['summary']}")


if __name__ == "__main__":
    main()
