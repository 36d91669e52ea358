"""Memory profiling of Llama 3 (Stanford CS336, assignment 2): peak memory of the forward pass and of the full
training step across model sizes, context lengths and precisions, through the trainer's own step.

    python scripts/profile_memory.py [--sizes "small medium large xl 2.7B"] [--contexts "128 256 512"]
        [--batch 4] [--passes "forward train"] [--precisions "fp32 bf16"] [--steps 2]
        [--output-dir outputs/profile_memory] [--dry-run] [--force] [train.py flags ...]

Every (size, context, pass, precision) is one fresh process (scripts/lib's `execute`: train.log, status.json with
ok / OOM / failed / timeout, so an out-of-memory run is a row of the table, not a crash) that builds the Trainer of
the causal LM on the embedded text (`--config`, default train_configs/llama3_debug.toml: training.dataset "stdlib")
and records `torchtitan.measure`'s memory breakdown: "forward" is the trainer's forward under torch.no_grad
(`--forward-only`), "train" the whole step (forward, backward, AdamW). "fp32" trains in float32, "bf16" under bf16
autocast (training.mixed_precision_param; CPU runs are float32 whatever it says). On a GPU the run records the
CUDA allocator's history and writes <output dir>/snapshots/<run>.pickle (drag it onto pytorch.org/memory_viz).

Written to <output dir>:
- runs/<run>/: train.log, status.json, result.json (the breakdown's records and peak), memory_breakdown*.json/.png;
- profile_memory.md and profile_memory.json: the peak-memory table (size x context against pass x precision); the
  activations of each training run against the derivation of torchtitan/tools/memory_estimate.py (one
  residual-stream tensor = B x T x d x bytes; the estimate's activations per layer and in total; the relative
  error of the estimate against the measured activations); the largest allocations alive at the peak, with their
  stack frames, read from each snapshot (GPU only).
"""

import argparse
import json
import pickle
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib import Run, execute, parse_script_args, read_status, words  # noqa: E402  (needs the root on the path)

SIZES = ("small", "medium", "large", "xl", "2.7B")  # CS336's model sizes (torchtitan/models/llama3/flavors.py)
PASSES = ("forward", "train")
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # -> training.mixed_precision_param
MIB, GIB = 1024**2, 1024**3
SNAPSHOT_ENTRIES = 200_000  # allocator events kept (a ring buffer): two steps of the 2.7B model fit
TOP_ALLOCATIONS = 8


def run_name(size: str, context: int, pass_: str, precision: str) -> str:
    return f"{size}_ctx{context}_{pass_}_{precision}"


def profile_run(size: str, context: int, pass_: str, precision: str, batch: int, config: str,
                extra: list[str]) -> Run:  # fmt: skip
    """The train.py arguments of one point: the causal LM of `size` on the config's text, eager, no AC; `extra`
    (the user's flags) last, so they win."""
    args = ["--job.config_file", config, "--model.flavor", size, "--model.num_classes", "0",
            "--training.seq_len", str(context), "--training.local_batch_size", str(batch),
            "--training.global_batch_size=-1", "--training.mixed_precision_param", PRECISIONS[precision],
            "--compile.enable", "false", "--activation_checkpoint.mode", "none"]  # fmt: skip
    knobs = {"size": size, "context": context, "pass": pass_, "precision": precision, "batch": batch}
    return Run(run_name(size, context, pass_, precision), [*args, *extra], knobs=knobs)


def child_command(run: Run, run_dir: Path, snapshot: Path, steps: int) -> list[str]:
    """The process of one run: this script's --child mode (the trainer's breakdown, the snapshot on a GPU)."""
    forward = ["--forward-only"] if run.knobs["pass"] == "forward" else []
    return [sys.executable, str(Path(__file__).resolve()), "--child", "--run-dir", str(run_dir), "--snapshot",
            str(snapshot), "--steps", str(steps), *forward, "--", *run.args]  # fmt: skip


def child_main(argv: list[str]) -> int:
    """In the run's own process: `measure_breakdown` of the trainer, with the CUDA allocator's history recorded
    from before the model is built; the snapshot is written even when the run runs out of memory (it shows what
    filled the device), then the error goes on to the launcher, which records "OOM"."""
    import torch

    from torchtitan.measure import measure_breakdown
    from torchtitan.tools.logging import init_logger

    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--forward-only", action="store_true")
    split = argv.index("--")
    opts, train_args = parser.parse_args(argv[:split]), argv[split + 1 :]
    init_logger()
    run_dir, cuda = Path(opts.run_dir), torch.cuda.is_available()
    if cuda:  # python frames only: C++ stacks make every allocation slow to record
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks="python")
    try:
        result = measure_breakdown(train_args, opts.forward_only, opts.steps, run_dir)
    finally:
        if cuda:
            Path(opts.snapshot).parent.mkdir(parents=True, exist_ok=True)
            with open(opts.snapshot, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            torch.cuda.memory._record_memory_history(enabled=None)
    records = result["records"]
    out = {"device": result["device"], "forward_only": opts.forward_only, "records": records,
           "peak_bytes": max(r["peak"] for r in records), "snapshot": opts.snapshot if cuda else None}  # fmt: skip
    (run_dir / "result.json").write_text(json.dumps(out, indent=1))
    return 0


def _frame_text(frame: dict) -> str:
    path = Path(frame.get("filename", "?"))
    try:
        path = path.resolve().relative_to(ROOT)
    except (ValueError, OSError):
        pass
    return f"{frame.get('name', '?')} ({path}:{frame.get('line', '?')})"


def _our_frames(frames: list[dict], keep: int = 5) -> list[str]:
    """The innermost frames in this repository's code (not its .venv), else the innermost frames of all."""
    ours = [f for f in frames if str(ROOT) in f.get("filename", "") and ".venv" not in f.get("filename", "")]
    return [_frame_text(f) for f in (ours or frames)[:keep]]


def largest_allocations(snapshot: dict, top: int = TOP_ALLOCATIONS) -> dict:
    """The largest allocations alive when the most memory was allocated, from a CUDA memory snapshot.

    Replays the allocator's history (snapshot["device_traces"]: alloc / free events with their stack frames) to
    the point of most bytes allocated; identical allocations (same size, same frames, e.g. one per layer) are
    counted together. Without a history (recording off), the blocks allocated when the snapshot was taken.

    Returns:
        {"source", "peak_bytes" (of the replayed history: allocations older than its window are not in it),
        "allocations": [{"bytes", "count", "frames": ["function (file:line)", ...]}, ...] largest first}.
    """
    traces = [t for t in snapshot.get("device_traces", []) if t]
    live: dict[int, tuple[int, tuple]] = {}
    peak_set: dict[int, tuple[int, tuple]] = {}
    total = peak = 0
    for event in traces[0] if traces else []:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], tuple(_our_frames(event.get("frames", []))))
            total += event["size"]
            if total > peak:
                peak, peak_set = total, dict(live)
        elif action in ("free_requested", "free_completed") and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    source = "device_traces (alive at the peak of the recorded history)"
    if not traces:  # no history: what the segments hold now
        source = "segments (blocks allocated when the snapshot was taken)"
        blocks = [b for seg in snapshot.get("segments", []) for b in seg.get("blocks", [])
                  if b.get("state") == "active_allocated"]  # fmt: skip
        peak_set = {i: (b["size"], tuple(_our_frames(b.get("frames", [])))) for i, b in enumerate(blocks)}
        peak = sum(size for size, _ in peak_set.values())
    grouped: dict[tuple, int] = {}
    for size, frames in peak_set.values():
        grouped[(size, frames)] = grouped.get((size, frames), 0) + 1
    ranked = sorted(grouped.items(), key=lambda kv: -kv[0][0])[:top]
    allocations = [{"bytes": size, "count": count, "frames": list(frames)} for (size, frames), count in ranked]
    return {"source": source, "peak_bytes": peak, "allocations": allocations}


def activation_derivation(train_args: list[str], device: str) -> dict:
    """The activation bytes of one training run as torchtitan/tools/memory_estimate.py derives them: one
    residual-stream tensor (B x T x d x bytes), the estimate's activations per layer and in total, and its lines.

    The residual-stream figures come from the model's shape alone; the estimate's, when it covers the model
    (otherwise "estimate_error" says why and they are left out): its activations plus the bf16 weight copies
    autocast keeps (the breakdown counts both as activations on a GPU), per layer and in total.
    """
    from torchtitan.config_manager import parse_args
    from torchtitan.train_spec import build_model_args, get_train_spec

    cfg = parse_args(train_args)
    args = build_model_args(get_train_spec(cfg.model.name), cfg)
    batch, seq, dim, layers = cfg.training.local_batch_size, cfg.training.seq_len, args.dim, args.n_layers
    nbytes = 2 if device == "cuda" and cfg.training.mixed_precision_param == "bfloat16" else 4
    residual = batch * seq * dim * nbytes
    formula = f"B x T x d x bytes = {batch} x {seq} x {dim} x {nbytes} B = {residual / MIB:.2f} MiB"
    out = {"batch": batch, "seq_len": seq, "dim": dim, "layers": layers, "bytes_per_element": nbytes,
           "residual_stream_bytes": residual, "formula": formula}  # fmt: skip
    try:
        from torchtitan.tools.memory_estimate import estimate_from_job_config

        est = estimate_from_job_config(cfg, 1, device)
        # What forward leaves for backward beside the tensor-owned parts, as the breakdown counts it: the saved
        # activations and, under bf16 autocast, the bf16 weight copies autocast keeps for backward.
        copies = est.parts.get("autocast_weight_copies", 0)
        activations = est.parts["activations"] + copies
    except Exception as e:  # noqa: BLE001  (an estimate that does not cover the model yet must not lose the runs)
        out["estimate_error"] = (f"torchtitan.tools.memory_estimate.estimate_from_job_config does not cover "
                                 f"{cfg.model.name} {cfg.model.flavor}: {type(e).__name__}: {e}")  # fmt: skip
        return out
    out.update(estimate_activations_bytes=activations, estimate_autocast_weight_copies_bytes=copies,
               estimate_per_layer_bytes=activations / layers,
               estimate_residual_tensors_per_layer=activations / layers / residual, estimate_peak_bytes=est.peak,
               estimate_parts=dict(est.parts), estimate_lines=list(est.lines))  # fmt: skip
    return out


def summarize(run: Run, run_dir: Path, snapshot: Path) -> dict:
    """One run's row: its knobs and status; when ok, the peak, the measured activations (the most a forward stage
    of the last, steady step held: the first also makes cuBLAS's workspace), the derivation and relative error,
    and the snapshot's largest allocations."""
    status = read_status(run_dir)
    row = {"name": run.name, **run.knobs, "status": status.get("status", "not run"), "run_dir": str(run_dir)}
    result_file = run_dir / "result.json"
    if snapshot.is_file():  # also after an OOM: the snapshot shows what filled the device
        row["snapshot"] = str(snapshot)
        row["largest_allocations"] = largest_allocations(pickle.loads(snapshot.read_bytes()))
    if row["status"] != "ok" or not result_file.is_file():
        return row
    result = json.loads(result_file.read_text())
    forward = [r for r in result["records"] if r["stage"] == "forward"]
    parameters = result["records"][0]["parameters"]
    row.update(device=result["device"], peak_bytes=result["peak_bytes"], parameters_bytes=parameters)
    if run.knobs["pass"] == "forward" or not forward:
        return row
    forward = [r for r in forward if r["step"] == forward[-1]["step"]]
    row["activations_bytes"] = max(r["activations"] for r in forward)
    row["saved_for_backward_bytes"] = max(r["saved_for_backward"] for r in forward)
    derivation = activation_derivation(run.args, result["device"])
    derivation["measured_residual_tensors_per_layer"] = (
        row["activations_bytes"] / derivation["layers"] / derivation["residual_stream_bytes"]
    )
    if "estimate_activations_bytes" in derivation:
        estimate = derivation["estimate_activations_bytes"]
        derivation["relative_error"] = (estimate - row["activations_bytes"]) / row["activations_bytes"]
    row["derivation"] = derivation
    return row


def _size(nbytes: float | None) -> str:
    if nbytes is None:
        return ""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def peak_table(rows: list[dict]) -> list[str]:
    """Size x context against pass x precision: the peak memory, or how the run ended."""
    columns = list(dict.fromkeys((r["pass"], r["precision"]) for r in rows))
    cells = {(r["size"], r["context"], r["pass"], r["precision"]): r for r in rows}
    body = []
    for size, context in dict.fromkeys((r["size"], r["context"]) for r in rows):
        line = [size, str(context)]
        for pass_, precision in columns:
            r = cells.get((size, context, pass_, precision))
            line.append("" if r is None else _size(r["peak_bytes"]) if r["status"] == "ok" else r["status"])
        body.append(line)
    return _table(["size", "context", *(f"{p} {q}" for p, q in columns)], body)


def cpu_note(rows: list[dict]) -> list[str]:
    """A line saying that bf16 runs on a CPU trained in float32 (the trainer's rule), when there are any."""
    if any(r["precision"] == "bf16" and r.get("device") == "cpu" for r in rows):
        return ["On CPU the trainer runs in float32 whatever the precision asks: the bf16 columns repeat fp32.", ""]
    return []


def activation_table(rows: list[dict]) -> list[str]:
    """Per training run: the residual-stream tensor, the estimate (per layer, total), the measured activations."""
    body = []
    for r in rows:
        d = r.get("derivation")
        if d is None:
            continue
        error = f"{100 * d['relative_error']:+.1f}%" if "relative_error" in d else "n/a"
        per_layer = d.get("estimate_residual_tensors_per_layer")
        body.append([r["size"], str(r["context"]), r["precision"], d["formula"],
                     _size(d.get("estimate_per_layer_bytes")) or "n/a",
                     "n/a" if per_layer is None else f"{per_layer:.2f}",
                     _size(d.get("estimate_activations_bytes")) or "n/a", _size(r["activations_bytes"]),
                     f"{d['measured_residual_tensors_per_layer']:.2f}", error])  # fmt: skip
    header = ["size", "context", "precision", "one residual-stream tensor", "estimate per layer",
              "estimate: residual tensors per layer", "estimate total", "measured activations",
              "measured: residual tensors per layer", "relative error"]  # fmt: skip
    return _table(header, body)


def allocation_lines(rows: list[dict]) -> list[str]:
    """The snapshots' largest allocations, per run, with their innermost frames in this repository."""
    with_snapshots = [r for r in rows if r.get("largest_allocations")]
    if not with_snapshots:
        devices = sorted({r.get("device", "?") for r in rows if r["status"] == "ok"})
        return [f"GPU only: CUDA memory snapshots need a CUDA device; these runs ran on {', '.join(devices)}."]
    lines = []
    for r in with_snapshots:
        found = r["largest_allocations"]
        lines += ["", f"### {r['name']} ({r['status']}; {found['source']}: {_size(found['peak_bytes'])})",
                  f"snapshot: {r['snapshot']}", ""]  # fmt: skip
        for a in found["allocations"]:
            lines.append(f"- {a['count']} x {_size(a['bytes'])}: " + " <- ".join(a["frames"] or ["(no frames)"]))
    return lines


def write_report(rows: list[dict], opts, out: Path) -> Path:
    """profile_memory.md and profile_memory.json."""
    settings = {"sizes": words(opts.sizes), "contexts": [int(c) for c in words(opts.contexts)], "batch": opts.batch,
                "passes": words(opts.passes), "precisions": words(opts.precisions), "steps": opts.steps,
                "config": opts.config}  # fmt: skip
    (out / "profile_memory.json").write_text(json.dumps({"settings": settings, "runs": rows}, indent=1))
    lines = ["# Memory profile (CS336 assignment 2), through the trainer", "",
             f"Causal LM on the embedded text ({opts.config}), batch {opts.batch}, {opts.steps} step(s) per run; "
             "forward = the trainer's forward under torch.no_grad, train = forward, backward and AdamW step.", "",
             "## Peak memory", "", *peak_table(rows), "", *cpu_note(rows),
             "## Activations: derivation against measurement (training runs)", "",
             "One residual-stream tensor is B x T x d x bytes; the estimate is torchtitan/tools/memory_estimate.py's "
             "activations (with autocast's bf16 weight copies under bf16), the measurement the breakdown's "
             "activations after the last step's forward (the bytes it asked the allocator for and keeps for "
             "backward, the logits included; the allocator's rounding and cuBLAS's workspaces are its \"other\"); "
             "relative error = (estimate - measured) / measured.", "",
             *activation_table(rows)]  # fmt: skip
    errors = sorted({r["derivation"]["estimate_error"] for r in rows if "estimate_error" in r.get("derivation", {})})
    lines += ["", *(f"Estimate unavailable: {e}" for e in errors)] if errors else []
    shown = set()
    for r in rows:  # the estimate's derivation once per size and precision (other contexts scale with B x T)
        d = r.get("derivation", {})
        if d.get("estimate_lines") and (r["size"], r["precision"]) not in shown:
            shown.add((r["size"], r["precision"]))
            lines += ["", f"Derivation of {r['name']} (memory_estimate):", "", "```", *d["estimate_lines"], "```"]
    lines += ["", "## Largest allocations at the peak (CUDA memory snapshots)", *allocation_lines(rows)]
    path = out / "profile_memory.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def parse_profile_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # fmt: skip
    parser.add_argument("--config", default="train_configs/llama3_debug.toml", help="TOML config of every run")
    parser.add_argument("--sizes", "--flavors", default=" ".join(SIZES), help="llama3 flavors, space separated")
    parser.add_argument("--contexts", default="128 256 512", help="context lengths (training.seq_len)")
    parser.add_argument("--batch", type=int, default=4, help="local batch size")
    parser.add_argument("--passes", default=" ".join(PASSES), help="forward (no_grad) and/or train (a full step)")
    parser.add_argument("--precisions", default=" ".join(PRECISIONS), help="fp32 and/or bf16 (autocast)")
    parser.add_argument("--steps", type=int, default=2, help="steps per run (the second is the steady state)")
    parser.add_argument("--output-dir", default="outputs/profile_memory")
    opts, extra = parse_script_args(parser, argv)
    if not Path(opts.config).is_file() and (ROOT / opts.config).is_file():  # run from another folder
        opts.config = str(ROOT / opts.config)
    for value, known, flag in ((opts.passes, PASSES, "--passes"), (opts.precisions, PRECISIONS, "--precisions")):
        unknown = [v for v in words(value) if v not in known]
        if unknown:
            raise SystemExit(f"{flag}: unknown {unknown}, use {list(known)}")
    return opts, extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        return child_main(argv)
    opts, extra = parse_profile_args(argv)
    out = Path(opts.output_dir).resolve()  # the runs' processes start in the repository root
    runs = [profile_run(size, int(context), pass_, precision, opts.batch, opts.config, extra)
            for size in words(opts.sizes) for context in words(opts.contexts) for precision in words(opts.precisions)
            for pass_ in words(opts.passes)]  # fmt: skip
    print(f"{len(runs)} runs, batch {opts.batch}, {opts.steps} step(s) each -> {out}/", flush=True)
    rows = []
    for run in runs:
        run_dir, snapshot = out / "runs" / run.name, out / "snapshots" / f"{run.name}.pickle"
        cmd = child_command(run, run_dir, snapshot, opts.steps)
        if opts.dry_run:
            print(f"{run.name}: {shlex.join(cmd)}")
            continue
        if opts.force or read_status(run_dir).get("status") != "ok":
            snapshot.unlink(missing_ok=True)  # a rerun must not show an old run's allocations
        execute(run, run_dir, opts.timeout or None, opts.force, cmd=cmd)
        rows.append(summarize(run, run_dir, snapshot))
    if not opts.dry_run:
        print(f"wrote {write_report(rows, opts, out)} and {out / 'profile_memory.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
