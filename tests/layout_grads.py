"""Run by tests/test_parallelisms.py under torchrun: the trainer's first-step gradients in several layouts.

    python -m torch.distributed.run --nproc_per_node=N tests/layout_grads.py OUT_DIR NAME='--key value ...' ...

For each NAME, builds the Trainer (torchtitan/trainer.py) from train.py's arguments, re-draws every parameter off its
initialization (adaLN-Zero starts every gate and the final layer at 0, which would hide most gradients), runs one
step's forward and backward through `Trainer.forward_backward`, and rank 0 saves {parameter name: full gradient} and
the trainer's own gradient norm to OUT_DIR/NAME.pt, with the weights as initialized.

A case `train:NAME='...'` is a whole run of train.py's main() in OUT_DIR/NAME instead (it must end with status 0):
the layout's training runs share its launch, since a launch costs each rank the trainer's imports. They go first,
before a gradient case's `--debug.deterministic` (which stays set in the process) could reach them.
"""

import shlex
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.components.ema import clean_fqn  # noqa: E402
from torchtitan.config_manager import parse_args  # noqa: E402
from torchtitan.parallelisms.utils import full_tensor_random_init  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int = 1234) -> None:
    """Adds N(0, 0.05^2) to every parameter: the same numbers in every layout (whole tensors drawn, shards kept)."""
    torch.manual_seed(seed)
    with full_tensor_random_init():
        for p in model.parameters():
            noise = torch.empty_like(p)
            noise.normal_(0.0, 0.05)
            p.add_(noise)


def first_step_gradients(args: list[str], dump_folder: Path) -> dict:
    trainer = Trainer(parse_args([*args, "--job.dump_folder", str(dump_folder)]))
    init = {clean_fqn(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in trainer.model.named_parameters()}  # fmt: skip
    perturb(trainer.model)
    for micro in range(trainer.grad_accum_steps):
        trainer.forward_backward(trainer.next_batch(), micro)
    grads = {}
    for name, p in trainer.model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[clean_fqn(name)] = grad.detach().cpu()
    result = {"init": init, "grads": grads, "grad_norm": trainer.grad_norm().item(), "rank": trainer.rank}
    if trainer.run_lock is not None:
        trainer.run_lock.release()
    return result


def main() -> None:
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        name, _, overrides = case.partition("=")
        torch._dynamo.reset()  # each case compiles afresh
        if name.startswith("train:"):
            import train

            name = name.removeprefix("train:")
            # One process group for every case of the launch: main() destroys it at its end, and a default group
            # created again met the last one's addresses in torchrun's store (gloo timed out connecting to an old
            # port, 1 launch in 3).
            with mock.patch.object(torch.distributed, "destroy_process_group"):
                status = train.main([*shlex.split(overrides), "--job.dump_folder", str(out / name)])
            assert status == 0, f"{name}: train.py's main() ended with status {status}"
            continue
        result = first_step_gradients(shlex.split(overrides), out / name)
        if result["rank"] == 0:
            torch.save({key: result[key] for key in ("init", "grads", "grad_norm")}, out / f"{name}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
