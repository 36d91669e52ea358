"""One logger that knows its rank: rank 0 prints INFO, other ranks only warnings."""

import logging
import os

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logger.handlers.clear()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
