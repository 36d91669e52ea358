"""Train a model from a TOML config (CLI > TOML > defaults); resumes by itself from the run folder.

    torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml [--section.key value ...]

Exit status: 0 done; 1 stopped by a non-finite step, a failed checkpoint save or an unreadable image met mid-run;
2 a bad config, a run folder in use or not writable, checkpoints that cannot be loaded or cannot continue this run
as configured, or an unreadable image met while building (nothing was trained).
"""

import gc
import sys

import torch

from torchtitan.components.checkpoint import CheckpointSaveError, NonFiniteStateError
from torchtitan.components.run_lock import RunFolderError
from torchtitan.components.step_guard import NonFiniteStepError
from torchtitan.config_manager import parse_args
from torchtitan.datasets.imagefolder import UnreadableImageError
from torchtitan.errors import CheckpointLoadError, ConfigError
from torchtitan.tools.logging import init_logger, logger
from torchtitan.trainer import Trainer

# Refusals before any training (status 2), and stops that keep every checkpoint (status 1): each message names
# what is at fault, so no traceback. An unreadable image, a data error named by its file, refuses the run when the
# build reads it and stops the run when a later batch meets it.
REFUSED = (ConfigError, RunFolderError, CheckpointLoadError, UnreadableImageError)
STOPPED = (NonFiniteStepError, NonFiniteStateError, CheckpointSaveError, UnreadableImageError)
# Stops every rank takes at the same step (the guard decides from all-reduced numbers): only after these, or a
# finished run, do the ranks meet at teardown. After any other failure (an OOM, an unreadable image: one rank's
# own) the others wait inside a collective, so a barrier would hang the job until NCCL's timeout; the failing rank
# leaves instead, and torchrun stops the rest.
TOGETHER = (NonFiniteStepError,)


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        trainer = Trainer(parse_args(argv))
    except REFUSED as e:
        logger.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    together = False
    try:
        trainer.train()
        together = True
    except STOPPED as e:
        together = isinstance(e, TOGETHER)
        logger.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError:
        trainer.profiler.dump_snapshot("oom")
        raise
    finally:
        trainer.close(together)
        # The trainer's modules and FSDP/DDP state form reference cycles (and GarbageCollection turned automatic
        # collection off) that hold the process groups' C++ objects: free them now, while the interpreter is whole,
        # not during its finalization, where gloo's teardown can abort the process ("terminate called").
        del trainer
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
