"""Scaling over GPUs from scripts/benchmark.py's JSON rows: a table and a plot of images/s against GPUs.

    python scripts/plot_scaling.py one.json two.json four.json --out assets/scaling_dit_xl2_h200x4.png

Each row (benchmark.py --json-out) carries `world_size` and `global_batch`; rows are grouped by the batch a GPU
(global batch / world size) and layout, and each multi-GPU row is set against the one-GPU row of the same batch a
GPU: scaling = images/s / (GPUs x one GPU's images/s), the figure our targets name (90% at 32 images a GPU, 95% at
64, 97% at 224). Rows that did not finish (status other than "ok") are listed, not plotted. Prints a markdown table
and writes the plot (dashed: linear scaling from one GPU) and, with --json-out, the table as JSON.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        data = json.loads(path.read_text())
        rows += data if isinstance(data, list) else [data]
    missing = [row.get("name", "?") for row in rows if "world_size" not in row]
    if missing:
        raise SystemExit(f"error: rows {missing} have no world_size (written before benchmark.py recorded it)")
    return rows


def scaling_table(rows: list[dict]) -> list[dict]:
    """One entry per finished row: GPUs, batch a GPU, layout, images/s and scaling against one GPU's (None where
    no one-GPU row of that batch a GPU exists)."""
    one_gpu = {}
    for row in rows:
        if row.get("status", "ok") == "ok" and row["world_size"] == 1:
            one_gpu.setdefault(row["global_batch"], row["images_per_second"])
    table = []
    for row in rows:
        if row.get("status", "ok") != "ok":
            continue
        gpus, per_gpu = row["world_size"], row["global_batch"] // row["world_size"]
        base = one_gpu.get(per_gpu)
        scaling = row["images_per_second"] / (gpus * base) if base else None
        table.append({"name": row["name"], "gpus": gpus, "batch_per_gpu": per_gpu, "layout": row.get("layout", ""),
                      "images_per_second": row["images_per_second"], "scaling": scaling})  # fmt: skip
    return sorted(table, key=lambda e: (e["batch_per_gpu"], e["layout"] != "single", e["layout"], e["gpus"]))


def markdown(table: list[dict]) -> str:
    lines = ["| case | GPUs | batch a GPU | layout | images/s | of linear |", "|---|---|---|---|---|---|"]
    for e in table:
        share = f"{100 * e['scaling']:.1f}%" if e["scaling"] is not None else ""
        lines.append(f"| {e['name']} | {e['gpus']} | {e['batch_per_gpu']} | {e['layout']} | "
                     f"{e['images_per_second']:.1f} | {share} |")  # fmt: skip
    return "\n".join(lines)


def plot(table: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    series = defaultdict(list)  # (batch a GPU, layout) -> [(GPUs, images/s)]
    for e in table:
        layout = "one GPU" if e["gpus"] == 1 else e["layout"]
        series[e["batch_per_gpu"]].append((e["gpus"], e["images_per_second"], layout))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for per_gpu, points in sorted(series.items()):
        points.sort()
        line = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"{per_gpu} a GPU")[0]
        base = [p[1] for p in points if p[0] == 1]
        if base:
            most = max(p[0] for p in points)
            ax.plot([1, most], [base[0], most * base[0]], "--", color=line.get_color(), linewidth=1)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("images/s")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+", type=Path, help="benchmark.py --json-out files")
    parser.add_argument("--out", type=Path, required=True, help="the plot (.png)")
    parser.add_argument("--title", default="images/s against GPUs (dashed: linear from one GPU)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    rows = read_rows(args.rows)
    table = scaling_table(rows)
    skipped = [f"{row['name']} ({row.get('status')})" for row in rows if row.get("status", "ok") != "ok"]
    print(markdown(table))
    if skipped:
        print(f"not finished: {', '.join(skipped)}")
    plot(table, args.out, args.title)
    if args.json_out:
        args.json_out.write_text(json.dumps(table, indent=1))
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
