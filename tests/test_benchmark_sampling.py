"""scripts/benchmarks/benchmark_sampling.py on stand-ins of both samplers, CPU.

The reference checkout is a stand-in made in tmp_path: a tiny models.py (`DiT_models`, with a zero-initialized
adaLN layer as the reference's), its download.py's `find_model`, and a sample_ddp.py with the reference's flags
that loads the checkpoint strictly into `DiT_models[--model]`, resolves the VAE's files as
`AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema")` does (huggingface_hub, offline), waits `WARMUP_S`
(model loading), writes its PNGs a batch every `BATCH_S` into the reference's folder layout, then waits again
(the .npz). REPA's checkout is one too: models/sit.py (SiT_models with its constructor), an empty loss.py and a
generate.py with its flags that loads the checkpoint's "ema" strictly and writes PNGs the same way. Our side is a
stand-in process given sample.py's real arguments, which prints sample.py's line. The VAE is a stand-in too
(importing diffusers takes about 20 s on CI's CPUs); the slow test builds the real ones.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scripts.benchmarks.benchmark_sampling as bench
from torchtitan.tools.runs import ROOT

MODELS = """
import torch
from torch import nn


class DiT(nn.Module):
    def __init__(self, input_size=32, num_classes=1000):
        super().__init__()
        self.in_channels = 4
        self.y_embedder = nn.Embedding(num_classes + 1, 8)
        self.proj = nn.Linear(4 * input_size, 8)
        self.adaLN_modulation = nn.Linear(8, 16)
        nn.init.constant_(self.adaLN_modulation.weight, 0)  # adaLN-Zero, as the reference's
        nn.init.constant_(self.adaLN_modulation.bias, 0)


DiT_models = {"DiT-XL/2": DiT}
"""

DOWNLOAD = """
import torch


def find_model(model_name):
    return torch.load(model_name, map_location=lambda storage, loc: storage)
"""

WARMUP_S, BATCH_S = 1.0, 0.3
SAMPLE_DDP = f"""
import argparse, json, math, os, time

import numpy as np
from huggingface_hub import hf_hub_download
from PIL import Image

from download import find_model
from models import DiT_models

parser = argparse.ArgumentParser()
parser.add_argument("--model", type=str, choices=list(DiT_models.keys()), default="DiT-XL/2")
parser.add_argument("--vae", type=str, choices=["ema", "mse"], default="ema")
parser.add_argument("--sample-dir", type=str, default="samples")
parser.add_argument("--per-proc-batch-size", type=int, default=32)
parser.add_argument("--num-fid-samples", type=int, default=50_000)
parser.add_argument("--image-size", type=int, choices=[256, 512], default=256)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--cfg-scale", type=float, default=1.5)
parser.add_argument("--num-sampling-steps", type=int, default=250)
parser.add_argument("--global-seed", type=int, default=0)
parser.add_argument("--ckpt", type=str, default=None)
args = parser.parse_args()

model = DiT_models[args.model](input_size=args.image_size // 8, num_classes=args.num_classes)
model.load_state_dict(find_model(args.ckpt))  # strict, as the reference's
repo = f"stabilityai/sd-vae-ft-{{args.vae}}"  # what AutoencoderKL.from_pretrained reads, offline
config = json.load(open(hf_hub_download(repo, "config.json")))
weights = hf_hub_download(repo, "diffusion_pytorch_model.safetensors")
ckpt_name = os.path.basename(args.ckpt).replace(".pt", "")
model_name = args.model.replace("/", "-")
folder = f"{{args.sample_dir}}/{{model_name}}-{{ckpt_name}}-size-{{args.image_size}}-vae-{{args.vae}}-" \\
         f"cfg-{{args.cfg_scale}}-seed-{{args.global_seed}}"
os.makedirs(folder)
with open(args.sample_dir + ".record.json", "w") as f:
    json.dump({{"args": vars(args), "vae_config": config, "vae_weights": weights,
               "torchrun": "LOCAL_RANK" in os.environ, "offline": os.environ.get("HF_HUB_OFFLINE")}}, f)
time.sleep({WARMUP_S})  # model loading, the first compilation
n = args.per_proc_batch_size
total = math.ceil(args.num_fid_samples / n) * n
for b in range(total // n):
    time.sleep({BATCH_S})  # sampling and decoding a batch
    for i in range(n):
        Image.fromarray(np.full((8, 8, 3), b, dtype=np.uint8)).save(f"{{folder}}/{{b * n + i:06d}}.png")
time.sleep({WARMUP_S})  # the .npz, after the last PNG
"""

# REPA's models/sit.py: SiT_models with its constructor (the projectors of z_dims, block kwargs), a zero-initialized
# adaLN layer. Its generate.py: its flags, the model built as it builds it, the checkpoint's "ema" loaded strictly,
# the VAE resolved offline, PNGs a batch every BATCH_S into its folder layout; it records its arguments, the GPU it
# was given and when it ran.
REPA_SIT = """
import torch
from torch import nn


class SiT(nn.Module):
    def __init__(self, input_size=32, num_classes=1000, use_cfg=False, z_dims=(768,), encoder_depth=8, **block_kwargs):
        super().__init__()
        assert set(block_kwargs) == {"fused_attn", "qk_norm"}, block_kwargs  # what its SiTBlock reads
        self.in_channels = 4
        self.y_embedder = nn.Embedding(num_classes + int(use_cfg), 8)
        self.proj = nn.Linear(4 * input_size, 8)
        self.projectors = nn.ModuleList([nn.Linear(8, z) for z in z_dims])
        self.adaLN_modulation = nn.Linear(8, 16)
        nn.init.constant_(self.adaLN_modulation.weight, 0)  # adaLN-Zero, as the reference's
        nn.init.constant_(self.adaLN_modulation.bias, 0)


SiT_models = {"SiT-XL/2": SiT}
"""

GENERATE = f"""
import argparse, json, math, os, sys, time

import numpy as np
import torch
from huggingface_hub import hf_hub_download
from PIL import Image

from models.sit import SiT_models

start = time.time()
parser = argparse.ArgumentParser()
parser.add_argument("--global-seed", type=int, default=0)
parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument("--ckpt", type=str, default=None)
parser.add_argument("--sample-dir", type=str, default="samples")
parser.add_argument("--model", type=str, choices=list(SiT_models.keys()), default="SiT-XL/2")
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--encoder-depth", type=int, default=8)
parser.add_argument("--resolution", type=int, choices=[256, 512], default=256)
parser.add_argument("--fused-attn", action=argparse.BooleanOptionalAction, default=False)
parser.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=False)
parser.add_argument("--vae", type=str, choices=["ema", "mse"], default="ema")
parser.add_argument("--per-proc-batch-size", type=int, default=32)
parser.add_argument("--num-fid-samples", type=int, default=50_000)
parser.add_argument("--mode", type=str, default="ode")
parser.add_argument("--cfg-scale", type=float, default=1.5)
parser.add_argument("--projector-embed-dims", type=str, default="768,1024")
parser.add_argument("--path-type", type=str, default="linear", choices=["linear", "cosine"])
parser.add_argument("--num-steps", type=int, default=50)
parser.add_argument("--heun", action=argparse.BooleanOptionalAction, default=False)
parser.add_argument("--guidance-low", type=float, default=0.)
parser.add_argument("--guidance-high", type=float, default=1.)
parser.add_argument("--legacy", action=argparse.BooleanOptionalAction, default=False)
args = parser.parse_args()

model = SiT_models[args.model](input_size=args.resolution // 8, num_classes=args.num_classes, use_cfg=True,
                               z_dims=[int(z) for z in args.projector_embed_dims.split(",")],
                               encoder_depth=args.encoder_depth, fused_attn=args.fused_attn, qk_norm=args.qk_norm)
model.load_state_dict(torch.load(args.ckpt)["ema"])  # strict, weights only, as the reference's
weights = hf_hub_download(f"stabilityai/sd-vae-ft-{{args.vae}}", "diffusion_pytorch_model.safetensors")
folder = f"{{args.sample_dir}}/{{args.model.replace('/', '-')}}-{{os.path.basename(args.ckpt).replace('.pt', '')}}-" \\
         f"size-{{args.resolution}}-vae-{{args.vae}}-cfg-{{args.cfg_scale}}-seed-{{args.global_seed}}-{{args.mode}}"
os.makedirs(folder, exist_ok=True)
time.sleep({WARMUP_S})  # model loading
n = args.per_proc_batch_size
for b in range(math.ceil(args.num_fid_samples / n)):
    time.sleep({BATCH_S})  # sampling and decoding a batch
    for i in range(n):
        Image.fromarray(np.full((8, 8, 3), b, dtype=np.uint8)).save(f"{{folder}}/{{b * n + i:06d}}.png")
with open(args.sample_dir + ".record.json", "w") as f:
    json.dump({{"args": vars(args), "vae_weights": weights, "torchrun": "LOCAL_RANK" in os.environ,
               "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time()}}, f)
"""

# Our stand-in: records its arguments, the GPU it was given and when it ran, sleeps (argv[1] "wait=FOLDER": until a
# PNG is in FOLDER, 60 s at most), and prints sample.py's line (unless argv[1] is "none") with the exact f-string
# sample.py uses.
OURS = """
import json, os, pathlib, sys, time

mode, argv = sys.argv[1], sys.argv[2:]
print_line = mode != "none"
start = time.perf_counter()
began = time.time()
time.sleep(1.0)
while mode.startswith("wait=") and not any(pathlib.Path(mode[5:]).rglob("*.png")) and time.time() < began + 60:
    time.sleep(0.05)
npz = argv[argv.index("--npz") + 1]
open(npz + ".argv.json", "w").write(json.dumps(argv))
open(npz + ".run.json", "w").write(json.dumps({"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": began,
                                               "end": time.time()}))
if print_line:
    n, seconds, rate = 6, 0.5, 12.0
    print(f"sampling: {n} images after the first batch in {seconds:.2f} s: {rate:.2f} images/s", file=sys.stderr)
"""

ARGS = ["--num-samples", "8", "--batch", "2", "--steps", "3", "--cfg-scale", "1.5"]


class StandInVAE:
    """What save_pretrained writes: config.json (with diffusers' class name) and a weights file."""

    def __init__(self, config: dict):
        self.config = config

    def save_pretrained(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", **self.config}))
        (Path(folder) / "diffusion_pytorch_model.safetensors").write_bytes(b"stand-in weights")


def write_reference(folder: Path, sample_ddp: bool = True) -> Path:
    folder.mkdir()
    (folder / "models.py").write_text(MODELS)
    (folder / "download.py").write_text(DOWNLOAD)
    if sample_ddp:
        (folder / "sample_ddp.py").write_text(SAMPLE_DDP)
    return folder


def write_repa(folder: Path) -> Path:
    (folder / "models").mkdir(parents=True)
    (folder / "models" / "sit.py").write_text(REPA_SIT)
    (folder / "loss.py").write_text("")
    (folder / "generate.py").write_text(GENERATE)
    return folder


@pytest.fixture
def stand_ins(tmp_path, monkeypatch) -> Path:
    """The reference checkout; our sampler and the VAE replaced by stand-ins."""
    real_command = bench.ours_command

    def ours_command(args, checkpoint, vae_dir, npz):
        cmd = real_command(args, checkpoint, vae_dir, npz)
        assert cmd[:2] == [sys.executable, str(ROOT / "sample.py")]
        return [sys.executable, "-c", OURS, "line" if "--print-line" in args.ours_extra else "none", *cmd[2:]]

    def build_vae(config, seed):
        assert config is bench.SD_VAE_CONFIG
        return StandInVAE(config)

    monkeypatch.setattr(bench, "ours_command", ours_command)
    monkeypatch.setattr(bench, "build_vae", build_vae)
    return write_reference(tmp_path / "ref_dit")


def test_side_by_side_rates_rows_and_table(stand_ins, tmp_path, capsys):
    """The reference's rate from its PNGs: 2 images every 0.3 s once warm (within 10%: sleeps overshoot a little;
    counting its 1 s warm-up would give about 3.6 images/s); ours from the line it printed (12.00 images/s)."""
    work, out = tmp_path / "work", tmp_path / "rows.json"
    argv = ["--reference-dit", str(stand_ins), *ARGS, "--keep-work", str(work), "--json-out", str(out),
            "--ours-extra", "--print-line.x 1"]  # fmt: skip
    assert bench.main(argv) == 0
    stdout = capsys.readouterr().out
    reference, ours = rows = json.loads(out.read_text())
    assert [json.loads(line) for line in stdout.splitlines() if line.startswith("{")] == rows
    assert reference["status"] == ours["status"] == "ok" and reference["side"] == "reference" and ours["side"] == "ours"
    assert reference["images"] == 8 and reference["timed_images"] == 6 and reference["timing"] == "png_mtime"
    assert reference["images_per_second"] == pytest.approx(2 / BATCH_S, rel=0.1)
    assert reference["images_per_second"] == pytest.approx(6 / reference["timed_s"])
    assert ours["timing"] == "sampling_line" and ours["images_per_second"] == 12.0
    assert ours["timed_images"] == 6 and ours["timed_s"] == 0.5
    assert ours["ratio_to_reference"] == pytest.approx(12.0 / reference["images_per_second"])
    for row in rows:
        assert row["batch"] == 2 and row["steps"] == 3 and row["num_samples"] == 8 and row["cfg_scale"] == 1.5
    assert f"| ours_sample_py | 12.00 | 2 | 3 | {ours['ratio_to_reference']:.2f} |" in stdout
    assert f"| reference_sample_ddp | {reference['images_per_second']:.2f} | 2 | 3 |  |" in stdout

    # The reference ran under torchrun, offline, with the run's flags, the checkpoint and the VAE in the hub cache.
    record = json.loads((work / "reference_samples.record.json").read_text())
    checkpoint = work / "DiT-XL-2-random.pt"
    assert record["torchrun"] and record["offline"] == "1"
    assert record["args"] | {"ckpt": str(checkpoint), "per_proc_batch_size": 2, "num_fid_samples": 8,
                             "num_sampling_steps": 3, "cfg_scale": 1.5, "vae": "ema"} == record["args"]  # fmt: skip
    snapshot = work / "hf" / "hub" / "models--stabilityai--sd-vae-ft-ema" / "snapshots" / bench.SNAPSHOT
    assert record["vae_config"] == {"_class_name": "AutoencoderKL", **bench.SD_VAE_CONFIG}
    assert Path(record["vae_weights"]) == snapshot / "diffusion_pytorch_model.safetensors"
    # The adaLN-Zero weights were given random values: no tensor of the checkpoint is zero.
    state = torch.load(checkpoint, weights_only=True)
    assert all(t.any() for t in state.values())
    assert 0.01 < state["adaLN_modulation.weight"].std() < 0.03

    # Ours ran sample.py's flags: the same checkpoint, setting and VAE folder, the reference's guidance, extras last.
    argv = json.loads((work / "ours.npz.argv.json").read_text())
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags == {"--checkpoint": str(checkpoint), "--flavor": "DiT-XL/2", "--model.input_size": "32",
                     "--npz": str(work / "ours.npz"), "--num-samples": "8", "--batch-size": "2", "--steps": "3",
                     "--cfg-scale": "1.5", "--guidance-channels": "3", "--sampler": "default", "--seed": "0",
                     "--latent.tokenizer": "diffusers", "--latent.checkpoint_dir": str(snapshot),
                     "--latent.scale_factor": "0.18215", "--print-line.x": "1"}  # fmt: skip


def test_ours_without_its_line_is_timed_by_wall_time(stand_ins, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--reference-dit", str(stand_ins), *ARGS, "--skip-reference", "--json-out", str(out)]) == 0
    (ours,) = json.loads(out.read_text())
    assert ours["timing"] == "wall_time" and ours["wall_s"] >= 1.0 and "ratio_to_reference" not in ours
    assert ours["images_per_second"] == pytest.approx(8 / ours["wall_s"]) and ours["timed_images"] == 8
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith("warning: sample.py printed no 'sampling: ") and "wall time" in warning


def test_png_rate_counts_the_batches_after_the_first(tmp_path):
    """Batches of 3 PNGs written at 10 s, 14 s, 18 s (a PNG every 0.1 s within a batch), in the reference's
    subfolder; the first batch's last PNG (10.2 s) starts the clock: 6 images in 18.2 - 10.2 = 8 s."""
    folder = tmp_path / "samples" / "DiT-XL-2-x"
    folder.mkdir(parents=True)
    for b, start_s in enumerate([10, 14, 18]):
        for i in range(3):
            path = folder / f"{3 * b + i:06d}.png"
            path.write_bytes(b"")
            ns = (start_s * 10 + i) * 100_000_000
            os.utime(path, ns=(ns, ns))
    rate = bench.png_rate(tmp_path / "samples", batch=3)
    assert rate == {"images": 9, "timed_images": 6, "timed_s": 8.0, "images_per_second": 0.75}
    with pytest.raises(ValueError, match="more than one batch"):
        bench.png_rate(tmp_path / "samples", batch=9)


def test_parse_sampling_line_takes_sample_py_format():
    n, seconds, rate = 4992, 301.4567, 16.56044
    line = f"sampling: {n} images after the first batch in {seconds:.2f} s: {rate:.2f} images/s"
    output = f"sampling: 100%|#####| 79/79 [05:03<00:00]\nsampling: 1 images after the first batch in 1.00 s: 1.00 images/s\n[rank0] {line}\nwrote 5056 samples\n"  # noqa: E501
    assert bench.parse_sampling_line(output) == {"timed_images": 4992, "timed_s": 301.46, "images_per_second": 16.56}
    assert bench.parse_sampling_line("sampling: 100%|#####| 79/79\n") is None


def test_hub_snapshot_resolves_offline(tmp_path):
    """The cache layout as huggingface_hub reads it (what diffusers' from_pretrained calls), in a fresh process
    with the script's environment: offline, cache under the work folder."""
    snapshot = bench.write_hub_snapshot(tmp_path / "hf" / "hub", bench.SD_VAE_REPO, StandInVAE({"latent_channels": 4}))
    assert (tmp_path / "hf" / "hub" / "models--stabilityai--sd-vae-ft-ema" / "refs" / "main").read_text() == (
        bench.SNAPSHOT
    )
    code = ("from huggingface_hub import hf_hub_download, snapshot_download; "
            "print(hf_hub_download('stabilityai/sd-vae-ft-ema', 'config.json')); "
            "print(snapshot_download('stabilityai/sd-vae-ft-ema'))")  # fmt: skip
    env = bench.hub_env(tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(snapshot / "config.json"), str(snapshot)]
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == str(tmp_path / "hf")


def test_missing_checkout_exits_2_with_one_error_line(tmp_path, capsys):
    missing = tmp_path / "no_dit_here"
    assert bench.main(["--reference-dit", str(missing)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert captured.out == "" and line.startswith("error: ") and "--reference-dit" in line
    assert str(missing / "sample_ddp.py") in line
    assert bench.main(["--reference-dit", str(missing), "--skip-reference"]) == 2  # models.py builds the checkpoint
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "--reference-dit" in line and str(missing / "models.py") in line


def test_bad_settings_exit_2_naming_the_flag(tmp_path, capsys):
    reference = str(write_reference(tmp_path / "ref_dit"))
    for flags, named in [(["--num-samples", "6", "--batch", "4"], "--num-samples 6"),
                         (["--num-samples", "4", "--batch", "4"], "--num-samples 4"),
                         (["--model", "DiT-S/2"], "--model 'DiT-S/2'")]:  # fmt: skip
        assert bench.main(["--reference-dit", reference, *flags]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and named in line, line


@pytest.mark.slow
def test_real_vae_loads_offline_in_both_samplers(tmp_path):
    """diffusers itself (about 20 s to import on CPU): SD_VAE_CONFIG builds SD-VAE's 83,653,863 parameters (the
    released sd-vae-ft-ema's .bin is 334,707,217 bytes: these in fp32 plus the pickle's ~92 KB); a small config
    written by `write_hub_snapshot` loads through the reference's `AutoencoderKL.from_pretrained(repo)` offline and
    through our tokenizer loader from the snapshot folder, with the same weights and the same decode."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT)!r})
import scripts.benchmarks.benchmark_sampling as bench
from diffusers.models import AutoencoderKL
from torchtitan.datasets.tokenizers import load_tokenizer

assert sum(p.numel() for p in bench.build_vae(bench.SD_VAE_CONFIG, 0).parameters()) == 83_653_863
small = dict(bench.SD_VAE_CONFIG, block_out_channels=[32, 32], down_block_types=["DownEncoderBlock2D"] * 2,
             up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1)
vae = bench.build_vae(small, 0)
snapshot = bench.write_hub_snapshot(bench.Path({str(tmp_path / "hf" / "hub")!r}), bench.SD_VAE_REPO, vae)
loaded = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema")
ours = load_tokenizer("diffusers", snapshot, parts=("decoder",))
z = torch.randn(2, 4, 4, 4)
with torch.no_grad():
    for name, p in vae.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name
    expected = vae.decode(z).sample.clamp(-1, 1)
    assert torch.allclose(loaded.decode(z).sample.clamp(-1, 1), expected, atol=1e-6)
    assert torch.allclose(ours.decode(z), expected, atol=1e-6)
print("ok")
"""
    env = bench.hub_env(tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "ok", proc.stderr[-3000:]


def test_repa_generate_and_ours_each_on_its_own_gpu_at_once(stand_ins, tmp_path, capsys, monkeypatch):
    """--reference-repa with --gpus 0,1: REPA's generate.py (its README's setting: SDE, 1.8 guided at t <= 0.7, one
    768-wide projector) on GPU 0 and ours with the same sampler, steps, guidance and batch on GPU 1, at the same time
    (ours waits for the reference's first PNG: one after the other, it would wait in vain or start after the
    reference ended); the reference's rate from its PNGs as sample_ddp.py's."""
    work, out = tmp_path / "work", tmp_path / "rows.json"
    stand_in = bench.ours_command
    waiting = lambda *args: [*stand_in(*args)[:3], f"wait={work / 'reference_samples'}", *stand_in(*args)[4:]]  # noqa: E731
    monkeypatch.setattr(bench, "ours_command", waiting)
    repa = write_repa(tmp_path / "ref_repa")
    argv = ["--reference-repa", str(repa), "--num-samples", "8", "--batch", "2", "--steps", "3", "--gpus", "0,1",
            "--keep-work", str(work), "--json-out", str(out), "--ours-extra", "--print-line.x 1"]  # fmt: skip
    assert bench.main(argv) == 0
    stdout = capsys.readouterr().out
    reference, ours = json.loads(out.read_text())
    assert reference["name"] == "reference_generate" and reference["status"] == ours["status"] == "ok"
    assert reference["timing"] == "png_mtime" and reference["images"] == 8 and reference["timed_images"] == 6
    assert reference["images_per_second"] == pytest.approx(2 / BATCH_S, rel=0.1)
    assert ours["ratio_to_reference"] == pytest.approx(12.0 / reference["images_per_second"])
    for row in (reference, ours):
        assert (row["mode"], row["heun"], row["steps"], row["batch"], row["cfg_scale"]) == ("sde", False, 3, 2, 1.8)
        assert (row["guidance_low"], row["guidance_high"]) == (0.0, 0.7)
    assert "| reference_generate |" in stdout and "| ours_sample_py | 12.00 | 2 | 3 |" in stdout

    record = json.loads((work / "reference_samples.record.json").read_text())
    checkpoint = work / "repa-SiT-XL-2-random.pt"
    assert record["torchrun"] and record["gpu"] == "0" and not record["args"]["fused_attn"]
    assert record["args"] | {"ckpt": str(checkpoint), "mode": "sde", "num_steps": 3, "heun": False, "cfg_scale": 1.8,
                             "guidance_low": 0.0, "guidance_high": 0.7, "per_proc_batch_size": 2,
                             "num_fid_samples": 8, "projector_embed_dims": "768", "encoder_depth": 8,
                             "path_type": "linear", "vae": "ema"} == record["args"]  # fmt: skip
    state = torch.load(checkpoint, weights_only=True)["ema"]  # what generate.py reads, loaded there strictly
    assert "projectors.0.weight" in state and all(t.any() for t in state.values())

    argv = json.loads((work / "ours.npz.argv.json").read_text())
    flags = dict(zip(argv[::2], argv[1::2]))
    assert {k: flags[k] for k in ("--checkpoint", "--flavor", "--steps", "--cfg-scale", "--batch-size", "--sampler",
                                  "--guidance-channels", "--guidance-low", "--guidance-high")} == {
        "--checkpoint": str(checkpoint), "--flavor": "SiT-XL/2", "--steps": "3", "--cfg-scale": "1.8",
        "--batch-size": "2", "--sampler": "sde", "--guidance-channels": "-1", "--guidance-low": "0.0",
        "--guidance-high": "0.7"}  # fmt: skip
    run = json.loads((work / "ours.npz.run.json").read_text())
    assert run["gpu"] == "1" and run["start"] < record["end"] and record["start"] < run["end"]  # at the same time
    assert run["end"] - run["start"] < 30  # it saw the reference's PNGs


def test_repa_ode_maps_to_our_euler_and_heun(tmp_path):
    """--mode ode is our 'euler', with --heun our 'heun' (REPA's heun: 2 N - 1 model calls, ours too)."""
    repa = tmp_path / "ref_repa"
    for flags, sampler in ((["--mode", "ode"], "euler"), (["--mode", "ode", "--heun"], "heun"), ([], "sde")):
        args = bench.parse_args(["--reference-repa", str(repa), *flags, "--guidance-high", "0.6"])
        reference = bench.reference_command(args, tmp_path / "c.pt", tmp_path / "s")
        assert bench.ours_sampler_flags(args)[:4] == ["--guidance-channels", "-1", "--sampler", sampler]
        assert ("--heun" in reference) == (sampler == "heun") and ("--no-heun" in reference) == (sampler != "heun")
        assert reference[reference.index("--mode") + 1] == (flags[1] if flags else "sde")
        assert reference[reference.index("--guidance-high") + 1] == "0.6"


def test_bad_repa_settings_exit_2_naming_the_flag(tmp_path, capsys):
    dit, repa = str(write_reference(tmp_path / "ref_dit")), str(write_repa(tmp_path / "ref_repa"))
    for argv, named in [(["--reference-dit", dit, "--guidance-high", "0.7"], "--guidance-high: REPA's generate.py"),
                        (["--reference-dit", dit, "--heun"], "--heun: REPA's generate.py settings"),
                        (["--reference-repa", repa, "--heun"], "--heun: REPA's ODE (--mode ode)"),
                        (["--reference-repa", repa, "--guidance-low", "0.8"], "--guidance-low 0.8 --guidance-high 0.7"),
                        (["--reference-repa", repa, "--gpus", "0"], "--gpus '0': two different GPUs"),
                        (["--reference-repa", repa, "--gpus", "1,1"], "--gpus '1,1'"),
                        (["--reference-repa", repa, "--model", "SiT-B/2"], "--model 'SiT-B/2' is not in the "),
                        (["--reference-repa", str(tmp_path / "none")], "--reference-repa")]:  # fmt: skip
        assert bench.main(argv) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and named in line, line
