"""Curves of a run's metrics.jsonl: training loss and, where the run validated, validation loss or perplexity.

python scripts/plot_metrics.py outputs/llama3_debug --out assets/llama3_debug_perplexity.png
"""

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run folder (job.dump_folder) holding metrics.jsonl")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--title", default="", help="defaults to the run folder's name")
    args = parser.parse_args(argv)
    path = Path(args.run) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (is {args.run} a run folder?)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    validation = [r for r in records if "validation_loss" in r]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    perplexity = bool(validation) and "validation_perplexity" in validation[0]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="training loss", color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)" if perplexity else "loss")
    if validation:
        key = "validation_perplexity" if perplexity else "validation_loss"
        other = ax.twinx() if perplexity else ax
        other.plot([r["step"] for r in validation], [r[key] for r in validation], "o-", color="tab:orange",
                   label=key.replace("_", " "))  # fmt: skip
        if perplexity:
            other.set_ylabel("validation perplexity")
        handles = ax.get_legend_handles_labels()[0] + (other.get_legend_handles_labels()[0] if perplexity else [])
        ax.legend(handles=handles, loc="upper right")
    ax.set_title(args.title or Path(args.run).name)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
