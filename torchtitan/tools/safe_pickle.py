"""Pickles read through an allow-list: the one way TorchDiTan reads a pickle it did not just write.

`pickle.load` calls whatever a file names (`os.system`, `builtins.eval`), so a crafted file runs code the moment it
is read. Every callable a pickle can invoke is looked up through `Unpickler.find_class` (GLOBAL, STACK_GLOBAL and
the extension registry alike), so refusing there refuses them all, before anything is called. Each reader names
the globals its files legitimately hold: CIFAR-10's python batches (torchtitan/datasets/cifar10.py) and DCP
checkpoints (torchtitan/components/checkpoint.py).
"""

import pickle
import types
from collections.abc import Collection
from typing import BinaryIO

import torch

# numpy arrays and scalars as pickles rebuild them: _reconstruct(ndarray, ...) and a dtype, or _frombuffer in
# protocol 5 (Python 3.14's default). numpy 2 spells numpy.core as numpy._core; files from numpy 1 name the old one.
NUMPY_ARRAY_GLOBALS = frozenset(
    {
        *((f"numpy.{core}.multiarray", name) for core in ("core", "_core") for name in ("_reconstruct", "scalar")),
        *((f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }
)

# What `torch.save` writes for tensors and state dicts: the tensor rebuild functions, storage types and dtypes, and
# OrderedDict. The readers of weight and statistics files (LightningDiT's checkpoints and latents_stats.pt, LDM
# autoencoders) admit these and their own few more.
TORCH_TENSOR_GLOBALS = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        *(
            ("torch", name)
            for name, value in vars(torch).items()
            if isinstance(value, type) and name.endswith("Storage")
        ),
        *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
        ("collections", "OrderedDict"),
    }
)


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A pickle names a global outside its reader's allow-list; nothing the pickle names was called. A ValueError
    too: a file that is not what its reader expects, as the CLIs and the config checks report them."""


def restricted_unpickler(allowed: Collection[tuple[str, str]], source: str, holder: str) -> type[pickle.Unpickler]:
    """An Unpickler class that admits only the (module, name) globals in `allowed`.

    Args:
        allowed: the globals the file may name.
        source: the file, as messages name it (e.g. "checkpoint run/checkpoint/step-4/.metadata").
        holder: what such a file is, as in "which {holder} may not hold" (e.g. "a checkpoint").
    """

    class RestrictedUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) not in allowed:
                raise UnsafePickleError(f"{source} refers to {module}.{name}, which {holder} may not hold (loading "
                                        "it could run code)")  # fmt: skip
            return super().find_class(module, name)

    return RestrictedUnpickler


def load(file: BinaryIO, allowed: Collection[tuple[str, str]], source: str, holder: str, **kwargs):
    """`pickle.load(file, **kwargs)` admitting only `allowed` globals.

    Raises:
        UnsafePickleError: the file names another global; the message names the file and the global.
    """
    return restricted_unpickler(allowed, source, holder)(file, **kwargs).load()


def torch_load(file: BinaryIO, allowed: Collection[tuple[str, str]], source: str, holder: str):
    """`torch.load` of a `torch.save` file (on the CPU) whose pickle may name only `allowed` globals; tensor storages
    are torch's own persistent records, which never reach `find_class` as callables.

    Raises:
        UnsafePickleError: the pickle names another global; the message names `source` and the global.
    """
    unpickler = restricted_unpickler(allowed, source, holder)
    module = types.SimpleNamespace(__name__=__name__, Unpickler=unpickler,
                                   load=lambda f, **kwargs: unpickler(f, **kwargs).load())  # fmt: skip
    # weights_only=False only because an explicit pickle_module replaces torch's own restricted one.
    return torch.load(file, map_location="cpu", pickle_module=module, weights_only=False)


def pickle_strings(path) -> set[str]:
    """The strings a torch.save file's pickle holds, read without unpickling it (no code runs, no tensor is read),
    for telling checkpoint formats apart; empty for torch.save's legacy (non-zip) format, a missing file or a
    damaged pickle (the reader that loads the file then names it)."""
    import pickletools
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            data = archive.read(name) if name else b""
    except (zipfile.BadZipFile, OSError):
        return set()
    try:
        return {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}
    except Exception:  # noqa: BLE001 (a damaged pickle: its reader names the file)
        return set()


def torch_load_file(path, allowed: Collection[tuple[str, str]], holder: str, where: str | None = None):
    """`torch_load` of the file at `path`, with what goes wrong named: `where` (default: the path) in the message.

    Raises:
        FileNotFoundError: no such file.
        UnsafePickleError: the file names code outside `allowed`.
        ValueError: a truncated file, or no torch.save file at all (torch's own message names no file).
    """
    from pathlib import Path

    where = where or str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{where}: no such file")
    with open(path, "rb") as f:
        try:
            return torch_load(f, allowed, str(path), holder)
        except UnsafePickleError:
            raise
        except Exception as e:  # noqa: BLE001 (named and re-raised)
            raise ValueError(f"{where}: not a readable torch.save file ({type(e).__name__}: {e})") from e
