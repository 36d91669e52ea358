"""Ablation grids over mixed precision x parallelism x batch size x activation checkpointing x compile.

The scripts/run_ablations_*.sh scripts set the grid and call this; every run is train.py on dummy latents
(64x64x16 for the 0.5B and 7B flavors, as the seed ran them) for a fixed number of steps, logged every step
so warm steps are apart from the first (compile) step. Each grid point is a scripts/lib `Run` whose knobs are
the point's settings; scripts/lib's `execute` runs it into `<output dir>/<name>/`: config.toml and
metrics.jsonl (train.py), train.log (its output) and status.json (ok / OOM / failed (exit code) / timeout, the
return code, the command and the knobs), so runs that fail are recorded, not dropped.

--autotune: one run per setting at the largest local batch that trains, found by the package's finder
(estimate, then bisection) over short runs of the grid point itself, recorded under
`<output dir>/autotune/<name>/`; the answers are kept in `<output dir>/autotune/<name>.json`.

Run names: dit_<size>_bs<local batch>ps<patch>_act<none|selective|full>_c<0|1><fp32|bf16>p<replicate>s<shard>,
e.g. dit_0.5B_bs32ps2_actnone_c1bf16p1s1 (one GPU) or dit_7B_bs4ps2_actfull_c1bf16p1s8 (FSDP over 8 GPUs).

    python scripts/run_ablation.py --size 0.5B --ngpu 8 --batch-sizes "16 32" [--dry-run] [train.py flags ...]
"""

import argparse
import re
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import lib  # noqa: E402  (needs the repository root on the path)

# size -> (config it starts from, flavor, model overrides)
SIZES = {
    "debug": ("train_configs/debug_model.toml", "debug", ["--model.input_size", "16", "--model.in_channels", "1"]),
    "0.5B": ("train_configs/debug_model.toml", "0.5B",
             ["--model.input_size", "64", "--model.in_channels", "16", "--model.num_classes", "1000"]),
    "7B": ("train_configs/dit_7B_latent.toml", "7B", ["--model.input_size", "64", "--model.in_channels", "16"]),
}  # fmt: skip
NAME_PATTERN = re.compile(
    r"^dit_(?P<size>.+?)_bs(?P<batch>\d+|auto)ps(?P<patch>\d+)_act(?P<ac>[a-z0-9]+)_c(?P<compile>[01])"
    r"(?P<precision>fp32|bf16)p(?P<replicate>\d+)s(?P<shard>\d+)$"
)


def run_name(knobs: dict) -> str:
    """The name of a grid point (batch 0: "auto", the finder's)."""
    k = knobs
    return (f"dit_{k['size']}_bs{k['batch'] or 'auto'}ps{k['patch']}_act{k['ac']}_c{int(k['compile'])}"
            f"{k['precision']}p{k['replicate']}s{k['shard']}")  # fmt: skip


def parse_name(name: str) -> dict | None:
    """The knobs a run name encodes (None if it does not follow the pattern)."""
    match = NAME_PATTERN.match(name)
    if match is None:
        return None
    d = match.groupdict()
    return {"size": d["size"], "batch": int(d["batch"]) if d["batch"] != "auto" else 0, "patch": int(d["patch"]),
            "ac": d["ac"], "compile": d["compile"] == "1", "precision": d["precision"],
            "replicate": int(d["replicate"]), "shard": int(d["shard"])}  # fmt: skip


def layouts(names: list[str], ngpu: int) -> list[tuple[int, int]]:
    """(replicate, shard) degrees per parallelism name; one GPU has a single layout, HSDP needs >= 4 GPUs."""
    if ngpu == 1:
        return [(1, 1)]
    table = {"ddp": (ngpu, 1), "fsdp": (1, ngpu)}
    if ngpu >= 4 and ngpu % 2 == 0:
        table["hsdp"] = (2, ngpu // 2)
    unknown = [n for n in names if n not in ("ddp", "fsdp", "hsdp")]
    if unknown:
        raise ValueError(f"unknown parallelism {unknown}: use ddp, fsdp, hsdp")
    return [table[n] for n in names if n in table]


def grid(size: str, ngpu: int, batch_sizes: list[int], precisions: list[str], parallelisms: list[str],
         ac_modes: list[str], compiles: list[bool]) -> list[dict]:  # fmt: skip
    """The knobs of every combination, batch sizes innermost so a row of the grid shares all other knobs."""
    from torchtitan.models.dit import dit_configs

    patch = dit_configs[SIZES[size][1]].patch_size
    return [{"size": size, "batch": b, "patch": patch, "ac": ac, "compile": c, "precision": mp, "replicate": r,
             "shard": s, "parallelism": lib.parallelism(r, s)}
            for mp in precisions for r, s in layouts(parallelisms, ngpu)
            for ac in ac_modes for c in compiles for b in batch_sizes]  # fmt: skip


def grid_run(knobs: dict, steps: int, extra: list[str]) -> lib.Run:
    """The run of a grid point: train.py flags of its knobs, then `extra` (the scripts' "$@"), last so it wins."""
    k = knobs
    config, flavor, model_args = SIZES[k["size"]]
    args = ["--job.config_file", config, "--model.flavor", flavor, *model_args, "--training.dataset", "dummy",
            "--training.steps", str(steps), "--training.global_batch_size=-1", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--sampling.freq", "0", "--checkpoint.enable", "false",
            "--training.mixed_precision_param", "float32" if k["precision"] == "fp32" else "bfloat16",
            "--parallelism.data_parallel_replicate_degree", str(k["replicate"]),
            "--parallelism.data_parallel_shard_degree", str(k["shard"]),
            "--activation_checkpoint.mode", k["ac"], "--compile.enable", str(k["compile"]).lower()]  # fmt: skip
    args += ["--training.local_batch_size", str(k["batch"])] if k["batch"] else []
    return lib.Run(run_name(k), [*args, *extra], k["replicate"] * k["shard"], knobs=k)


def autotune(knobs: dict, args, extra: list[str]) -> lib.Run | None:
    """The grid point's run at the largest batch the finder ran, or None (its status recorded) if none fits."""
    folder = Path(args.output_dir) / "autotune" / run_name(knobs)
    found = lib.find_max_batch(lambda b: grid_run({**knobs, "batch": b}, args.probe_steps, extra), folder,
                               args.autotune_limit, args.timeout or None, args.force)  # fmt: skip
    if found["batch"]:
        probes = ", ".join(f"{p['batch']} {p['status']}" for p in found.get("probes", []))
        bound = "at least " if found.get("lower_bound") else ""
        print(f"{run_name(knobs)}: the largest batch a GPU is {bound}{found['batch']} (probes: {probes})", flush=True)
        run = grid_run({**knobs, "batch": found["batch"]}, args.steps, extra)
        probe_dir, run_dir = folder / run.name, Path(args.output_dir) / run.name
        if args.steps == args.probe_steps and probe_dir.is_dir() and not run_dir.exists():
            shutil.copytree(probe_dir, run_dir)  # the probe at the answer is this very run: not trained twice
        return run
    smallest = grid_run({**knobs, "batch": 1}, args.steps, extra)
    run_dir = Path(args.output_dir) / smallest.name
    if found["batch"] == 0:
        lib.write_status(smallest, run_dir, "OOM", note="finder: batch 1 does not fit")
    else:  # a probe failed otherwise: its own folder under autotune/ holds the log
        lib.write_status(smallest, run_dir, "failed (finder)", note=found["error"])
    return None


def answer_line(run: lib.Run, run_dir: Path) -> str:
    """The autotune's answer for one setting: its run at the largest batch, warm steps (the first compiles)."""
    warm = lib.warm_metrics(run_dir, skip=1)
    rate = f"{warm['images_per_second']:.1f} images/s" if "images_per_second" in warm else "no images/s logged"
    mfu = f", {warm['mfu']:.1f}% MFU" if "mfu" in warm else ""
    memory = f", {warm['peak_memory_gib']:.1f} GiB peak active" if "peak_memory_gib" in warm else ""
    reserved = f" ({warm['reserved_gib']:.1f} reserved)" if "reserved_gib" in warm else ""
    return f"autotune answer: {run.name}: {run.knobs['batch']} a GPU, {rate}{mfu}{memory}{reserved}"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", required=True, choices=sorted(SIZES))
    parser.add_argument("--ngpu", type=int, default=0, help="processes per run (0: the visible GPUs, 1 on CPU)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-sizes", default="8 16 32", help="local batch sizes, space or comma separated")
    parser.add_argument("--output-dir", default="outputs")
    parser.add_argument("--precisions", default="fp32 bf16")
    parser.add_argument("--parallelisms", default="ddp fsdp hsdp")
    parser.add_argument("--ac", default="none selective full", help="activation checkpointing modes")
    parser.add_argument("--compile", default="0 1", help="0 (eager) and/or 1 (compiled blocks)")
    parser.add_argument("--autotune", action="store_true", help="one run per setting at the largest batch")
    parser.add_argument("--autotune-limit", type=int, default=1024, help="largest batch the finder tries")
    parser.add_argument("--probe-steps", type=int, default=3, help="training steps per finder probe")
    return lib.parse_script_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args, extra = parse_args(argv)
    ngpu = args.ngpu or max(1, torch.cuda.device_count())
    batches = [0] if args.autotune else [int(b) for b in lib.words(args.batch_sizes)]
    compiles = [c in ("1", "true", "on") for c in lib.words(args.compile)]
    points = grid(args.size, ngpu, batches, lib.words(args.precisions), lib.words(args.parallelisms),
                  lib.words(args.ac), compiles)  # fmt: skip
    output_dir = Path(args.output_dir)
    print(f"{len(points)} runs of {args.size} over {ngpu} process(es), {args.steps} steps each -> {output_dir}/")
    failed = 0
    for knobs in points:
        run = grid_run(knobs, args.steps, extra)
        if args.dry_run:
            what = "after find_max_batch_size: " if args.autotune else ""
            print(f"{run.name}: {what}{shlex.join(lib.train_command(run, output_dir / run.name))}")
            continue
        if args.autotune:
            run = autotune(knobs, args, extra)
            if run is None:
                failed += 1
                continue
        record = lib.execute(run, output_dir / run.name, args.timeout or None, args.force)
        failed += record["status"] != "ok"
        if args.autotune and record["status"] == "ok":
            print(answer_line(run, output_dir / run.name), flush=True)
    print(f"done: {failed} run(s) not ok (recorded in their status.json)" if not args.dry_run else "dry run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
