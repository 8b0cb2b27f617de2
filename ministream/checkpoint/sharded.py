"""Sharded training checkpoints (format.md, "Sharded checkpoints"): the folder `checkpoint/` that PyTorch's
distributed checkpoint (torch.distributed.checkpoint, DCP) writes from every rank of an FSDP run, read through
torch's own DCP reader one tensor at a time, and written as N ranks write it (for tests and the demo).

The reader asks torch for the "model." entries only: the optimizer's (twice the weights in float32 moments, and
pickled param groups) are never requested, so never read. Its `.metadata` is a pickle, which torch's reader
unpickles with plain `pickle.load`: here it is unpickled with only DCP's own metadata classes allowed, so a
checkpoint that needs code to be read is refused, never executed (as model.pt is read with weights_only).
"""

import io
import os
import pickle
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .. import MiniStreamError
from ..spec import check_stored_dtype

METADATA = ".metadata"  # DCP's index of every entry: its shape, dtype, chunks and which file holds each chunk
MODEL = "model."  # the entries of {"model": state dict, "optimizer": ...} that are the weights

# What DCP's .metadata pickle may name: its own dataclasses, torch's dtype/size/layout values, the path it was
# saved to. Nothing else is constructed.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _Refused(pickle.UnpicklingError):
    """The global the pickle names that is not DCP metadata's."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def is_sharded(folder: Path) -> bool:
    """A DCP folder: its index, or a rank's file (a folder whose .metadata is lost is still one, to say so)."""
    return folder.is_dir() and ((folder / METADATA).exists() or any(folder.glob("*.distcp")))


def read_metadata(folder: Path):
    """The folder's DCP metadata, unpickled with DCP's own classes only."""
    path = folder / METADATA
    if not path.is_file():
        ranks = sorted(p.name for p in folder.glob("*.distcp"))
        raise MiniStreamError(
            f"{path}: no such file; a sharded checkpoint's index, written by rank 0 once every rank has saved"
            + (f" ({len(ranks)} rank file(s) here: {', '.join(ranks[:3])})" if ranks else "")
            + ": the save did not finish, or the copy left it out: copy the whole checkpoint/ folder again"
        )
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except _Refused as e:
        raise MiniStreamError(
            f"{path}: the pickle needs code to be executed to load ({e}); it is refused. A checkpoint saved "
            "by torch.distributed.checkpoint names only its own metadata classes: save it again with dcp.save"
        ) from None
    except Exception as e:  # the unpickler raises many kinds for a truncated or foreign file
        raise _damaged(path, e) from None
    if not isinstance(metadata, Metadata):
        raise MiniStreamError(
            f"{path}: holds a {type(metadata).__name__}, not torch.distributed.checkpoint's Metadata; "
            "copy the checkpoint/ folder again from the training run"
        )
    return metadata


def _damaged(path: Path, e: Exception) -> MiniStreamError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return MiniStreamError(
        f"{path}: not a readable torch.distributed.checkpoint index ({first}); "
        "is it truncated? Copy the checkpoint/ folder again from the training run"
    )


def read_sharded(folder: Path, notes: list[str]) -> dict[str, torch.Tensor]:
    """The "model." entries of the DCP folder as {key without "model.": tensor}, each read on its own through
    torch's DCP reader (peak memory: the weights read so far and one chunk); the top-level entries that are
    not the model (the optimizer's) are named in `notes`, never read."""
    metadata = read_metadata(folder)
    entries = metadata.state_dict_metadata
    ignored = sorted({fqn.split(".")[0] for fqn in entries if not fqn.startswith(MODEL)})
    model = {fqn: md for fqn, md in entries.items() if fqn.startswith(MODEL)}
    if not model:
        raise MiniStreamError(
            f"{folder / METADATA}: no model.* entries (top-level entries: {', '.join(ignored) or 'none'}); "
            "format 1's trainer saves dcp.save({'model': model.state_dict(), 'optimizer': ...})"
        )
    if ignored:
        notes.append(f"ignored entries: {', '.join(ignored)}")
    for fqn, md in model.items():
        _check_entry(folder, metadata, fqn, md)
    reader = _reader(folder, metadata)
    return {fqn[len(MODEL) :]: _read_tensor(folder, reader, metadata, fqn) for fqn in model}


def _check_entry(folder: Path, metadata, fqn: str, md) -> None:
    """Before a byte is read: a tensor of the format's kind, whose chunks cover it once, each in a rank's file
    that holds it whole."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    index = folder / METADATA
    if not isinstance(md, TensorStorageMetadata):
        raise MiniStreamError(
            f"{index}: {fqn} is saved as pickled bytes, not a tensor; format 1's state dict holds tensors only: "
            "save model.state_dict() with dcp.save"
        )
    check_stored_dtype(index, fqn, md.properties.dtype)
    size, covered = tuple(md.size), 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in md.chunks:
        lo, n = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(lo) != len(size) or any(o < 0 or o + s > d for o, s, d in zip(lo, n, size)):
            raise _uncovered(index, fqn, size, f"a chunk at {list(lo)} of {list(n)} lies outside it")
        if any(all(a < c + t and c < a + s for a, s, c, t in zip(lo, n, *box)) for box in boxes):
            raise _uncovered(index, fqn, size, f"the chunk at {list(lo)} overlaps another")
        boxes.append((lo, n))
        covered += torch.Size(n).numel()
        where = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
        if where is None:
            raise _uncovered(index, fqn, size, f"no rank's file holds the chunk at {list(lo)}")
        file = folder / where.relative_path
        if not file.is_file():
            raise MiniStreamError(
                f"{file}: no such file; {index} says a rank wrote {fqn} (rows {lo[0] if lo else 0}..) there: "
                "every rank's __<rank>_<n>.distcp file is part of the checkpoint: copy the whole checkpoint/ "
                "folder again from the training run"
            )
        if file.stat().st_size < where.offset + where.length:
            raise MiniStreamError(
                f"{file}: {file.stat().st_size} bytes, but {index} says {fqn} lies at bytes {where.offset}.."
                f"{where.offset + where.length}: the file is truncated: copy it again from the training run"
            )
    if covered != torch.Size(size).numel():
        raise _uncovered(index, fqn, size, f"its chunks hold {covered} of its {torch.Size(size).numel()} values")


def _uncovered(index: Path, fqn: str, size: tuple, why: str) -> MiniStreamError:
    return MiniStreamError(
        f"{index}: {fqn} {list(size)}: {why}; the index does not describe a whole tensor: "
        "copy the checkpoint/ folder again from the training run"
    )


def _read_tensor(folder: Path, reader, metadata, fqn: str) -> torch.Tensor:
    """One entry through torch's DCP load (planner and FileSystemReader): its chunks from each rank's file into
    one tensor of the saved shape and dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    md = metadata.state_dict_metadata[fqn]
    target = {fqn: torch.empty(md.size, dtype=md.properties.dtype)}
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP wraps what torch.load raised in one (a BaseException)
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        lines = str(cause).splitlines()
        why = (
            "not a tensor torch.load reads" if isinstance(cause, pickle.UnpicklingError) else lines[0] if lines else ""
        )
        raise MiniStreamError(
            f"{folder / reader.reading}: {fqn} cannot be read from it ({why or type(cause).__name__}): the file is "
            "damaged: copy it again from the training run"
        ) from None
    return target[fqn]


def _reader(folder: Path, metadata):
    """torch's FileSystemReader of `folder`, given the metadata read safely above instead of unpickling it."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        reading = ""  # the rank's file of the chunk being read: the one an error names

        def read_metadata(self, *args: Any, **kwargs: Any):
            return metadata

        def _slice_file(self, file, sinfo):
            self.reading = sinfo.relative_path
            return super()._slice_file(file, sinfo)

    return Reader(folder)


# --- the writer: as N ranks of an FSDP run save -------------------------------------------------------------


def save_sharded(out: Path, state: dict[str, Any], ranks: int) -> None:
    """Write `state` ({"model": ..., "optimizer": ...}) to the DCP folder `out` as `ranks` FSDP ranks save it:
    `ranks` processes in a gloo group on this machine (a file store, loopback), every tensor of one or more
    dimensions a DTensor sharded by rows (FSDP2's Shard(0)), each rank writing its own __<rank>_0.distcp and
    rank 0 the index. The processes are forked, so each sees `state` without a copy."""
    import torch.multiprocessing as mp

    if ranks < 1:
        raise MiniStreamError(f"--ranks {ranks}: a sharded checkpoint is written by 1 or more ranks")
    out.parent.mkdir(parents=True, exist_ok=True)
    store = out.with_name(f".{out.name}.store")  # the group's rendezvous: a file, no port to find
    store.unlink(missing_ok=True)
    try:
        mp.start_processes(_save_rank, args=(ranks, out, store, state), nprocs=ranks, start_method="fork")
    except mp.ProcessRaisedException as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise MiniStreamError(
            f"{out}: writing the sharded checkpoint from {ranks} gloo ranks failed ({lines[-1] if lines else e})"
        ) from None
    finally:
        store.unlink(missing_ok=True)


def _save_rank(rank: int, ranks: int, out: Path, store: Path, state: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)  # a forked child: OpenMP's pool is the parent's; one thread never enters it
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=ranks, timeout=timedelta(minutes=10)
    )
    try:
        mesh = init_device_mesh("cpu", (ranks,))

        def shard(value):
            if isinstance(value, dict):
                return {k: shard(v) for k, v in value.items()}
            if isinstance(value, list):
                return [shard(v) for v in value]
            if isinstance(value, torch.Tensor) and value.dim():
                # each rank cuts its own rows from the whole tensor it already holds: no scatter
                return distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None)
            return value  # a scalar (Adam's step), a number or a name: replicated, saved once

        dcp.save(shard(state), storage_writer=dcp.FileSystemWriter(out))
    finally:
        dist.destroy_process_group()
