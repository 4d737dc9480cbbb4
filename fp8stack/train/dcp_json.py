"""torch.distributed.checkpoint storage whose loading unpickles nothing.

DCP's FileSystemWriter pickles the checkpoint's Metadata into `.metadata` and its reader unpickles it;
its default load planner reads non-tensor values (the optimizer's param_groups) with
torch.load(weights_only=False). Either runs whatever code a swapped file carries. Here the metadata is
JSON (METADATA_FILE) decoded into DCP's own dataclasses with every field type-checked, non-tensor values
are read with weights_only=True (DCP already reads tensors so), and any failure to decode is
UndecodableFileError. The tensor files are DCP's own, written by FileSystemWriter unchanged.
"""

import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)

METADATA_FILE = "metadata.json"
"""Where the JSON metadata goes, in place of DCP's pickled `.metadata`."""
FORMAT = "fp8stack-dcp-json/1"

_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}


class UndecodableFileError(RuntimeError):
    """A checkpoint file that is missing, truncated, or not what fp8stack writes there."""


class JsonMetadataWriter(FileSystemWriter):
    """FileSystemWriter that writes the metadata as JSON (METADATA_FILE), renamed into place when complete."""

    def finish(self, metadata: Metadata, results: list) -> None:
        metadata.version = CURRENT_DCP_VERSION  # as FileSystemWriter.finish records it
        storage = {result.index: result.storage_data for per_rank in results for result in per_rank}
        folder = Path(self.path)
        partial = folder / f"{METADATA_FILE}.partial"
        partial.write_text(json.dumps(_encode(metadata, storage)))
        os.replace(partial, folder / METADATA_FILE)


class JsonMetadataReader(FileSystemReader):
    """FileSystemReader of a JsonMetadataWriter checkpoint. The metadata is read and checked on construction
    (UndecodableFileError); reading a tensor file that does not decode raises UndecodableFileError too."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.metadata = read_metadata(Path(path))

    def read_metadata(self) -> Metadata:
        self.metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self.metadata

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except UndecodableFileError:
            raise
        except Exception as err:  # anything a file that does not decode raises, torch.load's errors included
            files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            reason = " ".join(str(err).split())[:200]
            raise UndecodableFileError(f"{', '.join(files)} does not decode ({type(err).__name__}: {reason})") from err


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(folder: Path) -> Metadata:
    """The checkpoint's metadata, after checking that every file it names is there and long enough."""
    path = folder / METADATA_FILE
    try:
        record = json.loads(path.read_bytes())
        metadata = _decode(record)
    except FileNotFoundError:
        raise UndecodableFileError(f"no {METADATA_FILE}") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:  # json's errors are ValueErrors
        raise UndecodableFileError(f"{METADATA_FILE} does not decode ({type(err).__name__}: {err})") from None
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (folder / name).stat().st_size if (folder / name).is_file() else None
        if size is None or size < end:
            raise UndecodableFileError(f"{name} is {'missing' if size is None else f'{size} bytes'}, where "
                                         f"{METADATA_FILE} expects {end}")
    return metadata


def _encode(metadata: Metadata, storage: dict) -> dict:
    tensors, byte_values = {}, []
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            byte_values.append(fqn)
            continue
        p = item.properties
        tensors[fqn] = {"dtype": str(p.dtype).removeprefix("torch."), "layout": _name(_LAYOUTS, p.layout),
                        "memory_format": _name(_MEMORY_FORMATS, p.memory_format),
                        "requires_grad": p.requires_grad, "pin_memory": p.pin_memory, "size": list(item.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
    return {"format": FORMAT, "version": metadata.version, "tensors": tensors, "bytes": byte_values,
            "planner_data": {key: list(path) for key, path in (metadata.planner_data or {}).items()},
            "storage": [{"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                         "index": index.index, "file": info.relative_path, "start": info.offset,
                         "length": info.length, "transforms": info.transform_descriptors}
                        for index, info in storage.items()]}


def _decode(record: dict) -> Metadata:
    if _of(record, dict).get("format") != FORMAT:
        raise ValueError(f"format is {record.get('format')!r}, not {FORMAT!r}")
    state = {fqn: BytesStorageMetadata() for fqn in _strings(record["bytes"])}
    for fqn, t in _of(record["tensors"], dict).items():
        properties = TensorProperties(dtype=_dtype(t["dtype"]), layout=_LAYOUTS[t["layout"]],
                                      requires_grad=_of(t["requires_grad"], bool),
                                      memory_format=_MEMORY_FORMATS[t["memory_format"]],
                                      pin_memory=_of(t["pin_memory"], bool))
        chunks = [ChunkStorageMetadata(offsets=_size(offsets), sizes=_size(sizes))
                  for offsets, sizes in _of(t["chunks"], list)]
        state[_of(fqn, str)] = TensorStorageMetadata(properties=properties, size=_size(t["size"]), chunks=chunks)
    storage = {}
    for s in _of(record["storage"], list):
        offset = None if s["offset"] is None else _size(s["offset"])
        index = MetadataIndex(fqn=_of(s["fqn"], str), offset=offset,
                              index=None if s["index"] is None else _count(s["index"]))
        transforms = None if s["transforms"] is None else _strings(s["transforms"])
        storage[index] = _StorageInfo(relative_path=_file_name(s["file"]), offset=_count(s["start"]),
                                      length=_count(s["length"]), transform_descriptors=transforms)
    planner_data = {_of(key, str): tuple(_of(part, (str, int)) for part in _of(path, list))
                    for key, path in _of(record["planner_data"], dict).items()}
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage,
                    version=_of(record["version"], str))


def _name(table: dict, value) -> str:
    names = [name for name, known in table.items() if known == value]
    if not names:
        raise ValueError(f"cannot record {value} in {METADATA_FILE}: use one of {', '.join(table)}")
    return names[0]


def _of(value, kind):
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise TypeError(f"{value!r} is not a {kind}")
    return value


def _count(value) -> int:
    if _of(value, int) < 0:
        raise ValueError(f"{value} is negative")
    return value


def _size(values) -> torch.Size:
    return torch.Size([_count(v) for v in _of(values, list)])


def _strings(values) -> list[str]:
    return [_of(v, str) for v in _of(values, list)]


def _dtype(name) -> torch.dtype:
    dtype = getattr(torch, _of(name, str), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _file_name(name) -> str:
    """A file of the checkpoint's own folder: no path a swapped metadata file could point elsewhere with."""
    if _of(name, str) != Path(name).name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a file name in the checkpoint folder")
    return name
