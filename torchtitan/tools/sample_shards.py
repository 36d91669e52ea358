"""ADM's sample .npz written in shards, which a killed run resumes from (`sample.py --npz`).

N samples make shards of `shard_size` consecutive samples: shard k holds samples k * shard_size onwards, in
`OUT.shards/shard-0000k.npz` (`arr_0` images, `arr_1` labels and `settings`, the JSON of what they were sampled with:
checkpoint, seed, sampler, steps, guidance, ...). A shard is written to a `.tmp` file and renamed once whole, so a
run killed at any moment leaves only whole shards. The same command run again samples only the shards that are
missing; a run with other settings is refused, naming the file and the setting, rather than mixed in. Once every
shard is there, one process streams them into OUT (`arr_0`, `arr_1` and `settings`, ADM's format plus the
settings), renames it into place and removes the shard folder; OUT itself is never overwritten by other settings.
"""

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np


def stored_settings(path: str | Path) -> dict | None:
    """The `settings` a shard or an assembled `sample.py --npz` file records, None when it has none.

    Raises:
        ValueError: the file cannot be read as an .npz (the message names it).
    """
    try:
        with np.load(path) as data:  # allow_pickle=False: nothing in the file is unpickled
            text = str(data["settings"]) if "settings" in data.files else None
        found = json.loads(text) if text is not None else None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: cannot be read ({e})") from e
    return found if isinstance(found, dict) else None


def _npy_header(zf: zipfile.ZipFile, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of one array of an .npz, from its header alone."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    with zf.open(name) as f:
        version = np.lib.format.read_magic(f)
        if version not in readers:
            raise ValueError(f"{zf.filename}: {name} is .npy version {version}, not 1.0 or 2.0")
        shape, _, dtype = readers[version](f)
    return shape, dtype


class ShardedSamples:
    """The shards of one `--npz` output.

    Args:
        out: the assembled .npz.
        num_samples: samples in the run.
        shard_size: samples per shard (the last may hold fewer).
        settings: what the samples are a function of (JSON-serializable); every shard must carry the same.
    """

    def __init__(self, out: Path, num_samples: int, shard_size: int, settings: dict):
        self.out, self.num_samples, self.shard_size = Path(out), num_samples, shard_size
        self.folder = self.out.with_name(self.out.name + ".shards")
        self.settings = json.loads(json.dumps(settings))  # as it reads back from a file: lists, not tuples
        self.num_shards = -(-num_samples // shard_size)

    def path(self, k: int) -> Path:
        return self.folder / f"shard-{k:05d}.npz"

    def indices(self, k: int) -> range:
        """The samples of shard k."""
        return range(k * self.shard_size, min((k + 1) * self.shard_size, self.num_samples))

    def _check(self, path: Path) -> None:
        found = stored_settings(path)
        if found is None:
            raise ValueError(f"{path}: has no settings (not written by sample.py --npz)")
        for key in sorted(set(found) | set(self.settings)):
            if found.get(key) != self.settings.get(key):
                old, new = (json.dumps(side.get(key)) for side in (found, self.settings))
                raise ValueError(f"{path} was sampled with {key} {old}, this run asks {key} {new}: run the command "
                                 f"that made it, or remove {self.folder if path != self.out else path} to start "
                                 "over")  # fmt: skip

    def assembled(self) -> bool:
        """True when OUT is already there with these settings (a finished run asked again); raises ValueError when
        OUT exists with other settings or none: it is never overwritten."""
        if not self.out.exists():
            return False
        try:
            self._check(self.out)
        except ValueError as e:
            raise ValueError(f"--npz {self.out} exists: {e}") from None
        return True

    def done(self) -> set[int]:
        """The shards already written, each checked against this run's settings and its size.

        Raises:
            ValueError: a shard of other settings, or not of its samples' count (the message names the file).
        """
        found = set()
        for k in range(self.num_shards):
            path = self.path(k)
            if not path.is_file():
                continue
            self._check(path)
            with zipfile.ZipFile(path) as zf:
                shape, _ = _npy_header(zf, "arr_0.npy")
            if shape[0] != len(self.indices(k)):
                raise ValueError(f"{path} holds {shape[0]} samples, shard {k} has {len(self.indices(k))}: remove it "
                                 "to sample it again")  # fmt: skip
            found.add(k)
        return found

    def write(self, k: int, images: np.ndarray, labels: np.ndarray) -> None:
        """Shard k, whole or not at all: a .tmp file renamed into place."""
        if len(images) != len(self.indices(k)):
            raise ValueError(f"shard {k}: {len(images)} images for {len(self.indices(k))} samples")
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path(k).with_name(self.path(k).name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, arr_0=images, arr_1=labels, settings=np.array(json.dumps(self.settings)))
        os.replace(tmp, self.path(k))

    def assemble(self) -> Path:
        """Streams every shard, in order, into OUT (through OUT.tmp, renamed when whole), then removes the shards.

        Memory holds one shard at a time: 50,000 images at 256 x 256 are 9.8 GB.

        Raises:
            ValueError: a shard is missing.
        """
        missing = [k for k in range(self.num_shards) if not self.path(k).is_file()]
        if missing:
            raise ValueError(f"{self.folder}: shards {missing[:5]} are missing; run the same command again")
        with zipfile.ZipFile(self.path(0)) as zf:
            (_, *image_shape), dtype = _npy_header(zf, "arr_0.npy")
        tmp = self.out.with_name(self.out.name + ".tmp")
        labels = []
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as f:
                header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                          "shape": (self.num_samples, *image_shape)}  # fmt: skip
                np.lib.format.write_array_header_1_0(f, header)
                for k in range(self.num_shards):
                    with np.load(self.path(k)) as shard:
                        images = shard["arr_0"]
                        if images.shape[1:] != tuple(image_shape) or images.dtype != dtype:
                            raise ValueError(f"{self.path(k)}: arr_0 is {images.shape} {images.dtype}, shard 0's "
                                             f"{tuple(image_shape)} {dtype}")  # fmt: skip
                        f.write(np.ascontiguousarray(images).data)
                        labels.append(shard["arr_1"])
            for name, array in (("arr_1", np.concatenate(labels)), ("settings", np.array(json.dumps(self.settings)))):
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, array, allow_pickle=False)
        os.replace(tmp, self.out)
        shutil.rmtree(self.folder)
        return self.out

    def remove_leftovers(self) -> None:
        """The shard folder of a run killed after OUT was renamed into place, before the folder went."""
        shutil.rmtree(self.folder, ignore_errors=True)
