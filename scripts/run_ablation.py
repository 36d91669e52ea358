"""Ablation grids over mixed precision x parallelism x batch size x activation checkpointing x compile.

The scripts/run_ablations_*.sh scripts set the grid and call this; every run is train.py on dummy latents
(64x64x16 for the 0.5B and 7B flavors, as the seed ran them) for a fixed number of steps, logged every step
so warm steps are apart from the first (compile) step. Each run writes `<output dir>/<name>/`:
config.toml and metrics.jsonl (train.py), train.log (its output) and status.json (ok / OOM / failed, the
return code, the command and the knobs), so runs that fail are recorded, not dropped.

Run names: dit_<size>_bs<local batch>ps<patch>_act<none|selective|full>_c<0|1><fp32|bf16>p<replicate>s<shard>,
e.g. dit_0.5B_bs32ps2_actnone_c1bf16p1s1 (one GPU) or dit_7B_bs4ps2_actfull_c1bf16p1s8 (FSDP over 8 GPUs).

    python scripts/run_ablation.py --size 0.5B --ngpu 8 --batch-sizes "16 32" [--dry-run] [train.py flags ...]
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


@dataclass
class RunSpec:
    """One point of the grid; batch 0 means 'the largest that fits' (autotune)."""

    size: str
    batch: int
    patch: int
    ac: str
    compile: bool
    precision: str  # "fp32" | "bf16"
    replicate: int
    shard: int

    @property
    def name(self) -> str:
        batch = self.batch or "auto"
        return (f"dit_{self.size}_bs{batch}ps{self.patch}_act{self.ac}_c{int(self.compile)}{self.precision}"
                f"p{self.replicate}s{self.shard}")  # fmt: skip

    @property
    def parallelism(self) -> str:
        if self.replicate > 1 and self.shard > 1:
            return "hsdp"
        return "fsdp" if self.shard > 1 else ("ddp" if self.replicate > 1 else "single")


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
         ac_modes: list[str], compiles: list[bool]) -> list[RunSpec]:  # fmt: skip
    """Every combination, batch sizes innermost so a row of the grid shares all other knobs."""
    from torchtitan.models.dit import dit_configs

    patch = dit_configs[SIZES[size][1]].patch_size
    return [RunSpec(size, b, patch, ac, c, mp, r, s) for mp in precisions for r, s in layouts(parallelisms, ngpu)
            for ac in ac_modes for c in compiles for b in batch_sizes]  # fmt: skip


def spec_args(spec: RunSpec, steps: int) -> list[str]:
    """train.py flags of a run, without its output folder (the finder's probes reuse them)."""
    _, flavor, model_args = SIZES[spec.size]
    args = ["--model.flavor", flavor, *model_args, "--training.dataset", "dummy", "--training.steps", str(steps),
            "--training.global_batch_size=-1", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--sampling.freq", "0", "--checkpoint.enable", "false",
            "--training.mixed_precision_param", "float32" if spec.precision == "fp32" else "bfloat16",
            "--parallelism.data_parallel_replicate_degree", str(spec.replicate),
            "--parallelism.data_parallel_shard_degree", str(spec.shard),
            "--activation_checkpoint.mode", spec.ac, "--compile.enable", str(spec.compile).lower()]  # fmt: skip
    return args + (["--training.local_batch_size", str(spec.batch)] if spec.batch else [])


def train_command(spec: RunSpec, steps: int, output_dir: Path, extra: list[str]) -> list[str]:
    """The full command of one run; `extra` (the scripts' "$@") comes last, so it wins."""
    nproc = spec.replicate * spec.shard
    launcher = [sys.executable, "train.py"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "train.py"]  # fmt: skip
    config = SIZES[spec.size][0]
    return [*launcher, "--job.config_file", config, *spec_args(spec, steps), "--job.dump_folder",
            str(output_dir / spec.name), *extra]  # fmt: skip


def execute(spec: RunSpec, cmd: list[str], run_dir: Path, timeout: float | None = None) -> dict:
    """Runs one command, its output to run_dir/train.log; writes and returns status.json's content."""
    from torchtitan.tools.batch_size_finder import ran_out_of_memory

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # train.py appends: a rerun starts clean
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        try:
            returncode = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            returncode = -9
    text = (run_dir / "train.log").read_text(errors="replace")
    if returncode == 0:
        status = "ok"
    elif ran_out_of_memory(text):
        status = "OOM"
    else:
        status = "timeout" if returncode == -9 else "failed"
    record = {"name": spec.name, "status": status, "returncode": returncode, "elapsed_s": time.perf_counter() - start,
              "command": shlex.join(cmd), "spec": asdict(spec), "parallelism": spec.parallelism}  # fmt: skip
    (run_dir / "status.json").write_text(json.dumps(record, indent=1))
    print(f"{spec.name}: {status} (returncode {returncode}, {record['elapsed_s']:.0f} s)", flush=True)
    return record


def already_done(run_dir: Path) -> bool:
    status = run_dir / "status.json"
    return status.is_file() and json.loads(status.read_text()).get("status") == "ok"


def autotune(spec: RunSpec, args, extra: list[str]) -> RunSpec | None:
    """The spec at the largest batch the finder runs, or None (status OOM recorded) if batch 1 does not fit."""
    from torchtitan.tools.batch_size_finder import find_max_local_batch_size

    found_file = Path(args.output_dir) / "autotune" / f"{spec.name}.json"
    if found_file.is_file() and not args.force:  # the search is the expensive part: keep its answer
        result = json.loads(found_file.read_text())
    else:
        probe_args = [a for a in spec_args(spec, args.steps) if a != "--training.global_batch_size=-1"] + extra
        result = find_max_local_batch_size(SIZES[spec.size][0], probe_args, spec.replicate * spec.shard,
                                           steps=args.probe_steps, limit=args.autotune_limit)  # fmt: skip
        found_file.parent.mkdir(parents=True, exist_ok=True)
        found_file.write_text(json.dumps(result, indent=1))
    if result["batch"] == 0:
        found = RunSpec(**{**asdict(spec), "batch": 1})
        run_dir = Path(args.output_dir) / found.name
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"name": found.name, "status": "OOM", "returncode": None, "note": "finder: batch 1 does not fit",
                  "spec": asdict(found), "parallelism": found.parallelism}  # fmt: skip
        (run_dir / "status.json").write_text(json.dumps(record, indent=1))
        return None
    return RunSpec(**{**asdict(spec), "batch": result["batch"]})


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[,\s]+", text) if w]


def main(argv: list[str] | None = None) -> int:
    import torch

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
    parser.add_argument("--probe-steps", type=int, default=3, help="timed steps per finder probe")
    parser.add_argument("--timeout", type=float, default=0, help="seconds per run (0: none)")
    parser.add_argument("--force", action="store_true", help="rerun runs whose status is already ok")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    ngpu = args.ngpu or max(1, torch.cuda.device_count())
    batches = [0] if args.autotune else [int(b) for b in _words(args.batch_sizes)]
    specs = grid(args.size, ngpu, batches, _words(args.precisions), _words(args.parallelisms), _words(args.ac),
                 [c in ("1", "true", "on") for c in _words(args.compile)])  # fmt: skip
    output_dir = Path(args.output_dir)
    print(f"{len(specs)} runs of {args.size} over {ngpu} process(es), {args.steps} steps each -> {output_dir}/")
    failed = 0
    for spec in specs:
        if args.dry_run:
            what = "after find_max_batch_size: " if args.autotune else ""
            print(f"{spec.name}: {what}{shlex.join(train_command(spec, args.steps, output_dir, extra))}")
            continue
        if args.autotune:
            spec = autotune(spec, args, extra)
            if spec is None:
                continue
        run_dir = output_dir / spec.name
        if already_done(run_dir) and not args.force:
            print(f"{spec.name}: ok already, skipped (--force reruns)")
            continue
        record = execute(spec, train_command(spec, args.steps, output_dir, extra), run_dir, args.timeout or None)
        failed += record["status"] != "ok"
    print(f"done: {failed} run(s) not ok (recorded in their status.json)" if not args.dry_run else "dry run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
