"""Real text with no download: the running interpreter's own standard-library .py sources, as bytes
(source 'stdlib'), or those followed by the .py sources of its site-packages folders (source 'python':
torch's sources and the rest, several times the text, for long loss runs that must stay under one pass).

Byte-level tokens (ids 0..255) fit any model with vocab_size >= 256. Files go to the train or the
validation split by a hash of their path relative to their root folder (the stdlib's, a site-packages
folder), so the split is the same on every machine with the same Python and packages. Batch i of a
given (seed, split, rank) is a pure function of those four numbers: every A/B arm and every process sees
the same tokens, and a resumed run continues from `position` alone. Data-parallel ranks take consecutive
slices of one global batch, so N ranks with micro-batch b train on exactly the batches of 1 rank with
micro-batch N*b.
"""

import fnmatch
import hashlib
import os
import site
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from fp8stack.config.job import DATA_SOURCES, DEFAULT_MAX_BYTES

SPLITS = ("train", "validation")
VALIDATION_PERCENT = 10
"""Share of files (by path hash) that form the validation split."""
FILE_SEPARATOR = b"\n\n"
"""Between concatenated files, so no window glues two files' lines together."""
THIRD_PARTY_FOLDERS = ("site-packages", "dist-packages")
"""Folders of installed packages, left out of a root's sources (the stdlib folder may hold its own site-packages)."""


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_roots(source: str) -> list[Path]:
    """The folders whose .py files make up `source`, read in this order."""
    if source not in DATA_SOURCES:
        raise ValueError(f"unknown data source {source!r}: use one of {', '.join(DATA_SOURCES)}")
    packages = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()] if source == "python" else []
    return list(dict.fromkeys([stdlib_root(), *sorted(packages)]))


def split_of(relative_path: str) -> str:
    """'train' or 'validation' for a file, from a hash of its relative path (stable across runs)."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:4], "big") % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def source_files(root: Path) -> list[Path]:
    """Every .py file under `root` in sorted order, without third-party packages: what `root.rglob("*.py")` finds
    outside folders named site-packages or dist-packages, in Path order. A run lists the stdlib for each split it
    reads and again in preflight: os.walk, which skips those folders rather than listing them, and sorting strings
    take a fraction of the time rglob, relative_to and sorting Paths took (0.04 s against 0.25 s)."""
    found = []
    for folder, folders, files in os.walk(root):
        folders[:] = [name for name in folders if name not in THIRD_PARTY_FOLDERS]
        found += [os.path.join(folder, name) for name in (*folders, *files) if fnmatch.fnmatch(name, "*.py")]
    # Path order (PurePath.__lt__ compares the normcased parts), without making a Path of each file to sort it
    return [Path(path) for path in sorted(found, key=lambda path: os.path.normcase(path).split(os.sep))]


def load_split(split: str, max_bytes: int = DEFAULT_MAX_BYTES, roots: list[Path] | None = None,
               source: str = "stdlib") -> torch.Tensor:
    """The split's text as a 1-D uint8 tensor: the files of `roots` (default: those of `source`) in order,
    each root's sorted, until `max_bytes` (both splits together) have been read."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    roots = roots or source_roots(source)
    chunks, read = [], 0
    for root, path in ((root, path) for root in roots for path in source_files(root)):  # a root is listed when reached
        if read >= max_bytes:
            break
        text = path.read_bytes()
        read += len(text)
        if split_of(path.relative_to(root).as_posix()) == split:
            chunks += [text, FILE_SEPARATOR]
    data = b"".join(chunks)
    if not data:
        raise RuntimeError(f"no Python sources for the {split} split under {', '.join(map(str, roots))} (first "
                           f"{max_bytes} bytes): raise max_bytes or check that the interpreter ships its standard "
                           "library")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class TextData:
    """Batches of (tokens, targets) [micro_batch, seq_len] int64 CPU tensors, targets shifted by one.

    Batch i of the global batch (micro_batch * ranks windows) starts its windows at random offsets drawn
    from a generator seeded by (seed, split, batch index); rank r takes windows r*micro_batch onwards.
    """

    def __init__(self, seq_len: int, micro_batch: int, seed: int, split: str = "train", *,
                 rank: int = 0, ranks: int = 1, max_bytes: int = DEFAULT_MAX_BYTES, source: str = "stdlib"):
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not one of the {ranks} data-parallel ranks: pass 0 <= rank < ranks")
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.split = split
        self.rank = rank
        self.ranks = ranks
        self.text = load_split(split, max_bytes, source=source)
        if self.text.numel() <= seq_len + 1:
            raise ValueError(f"the {split} split holds {self.text.numel()} bytes, too few for seq_len={seq_len}: "
                             "raise max_bytes or lower seq_len")
        self.position = 0
        """Index of the next batch; save it to resume."""

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of global batch number `index`, independent of what was drawn before."""
        # The 0 stands where the rank once was: single-process batches stay what they always were.
        generator = torch.Generator().manual_seed(_mix(self.seed, SPLITS.index(self.split), 0, index))
        everyone = torch.randint(0, self.text.numel() - self.seq_len - 1, (self.micro_batch * self.ranks,),
                                 generator=generator)
        starts = everyone[self.rank * self.micro_batch: (self.rank + 1) * self.micro_batch]
        windows = torch.stack([self.text[s: s + self.seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens_targets = self.batch(self.position)
        self.position += 1
        return tokens_targets


def _mix(*numbers: int) -> int:
    """One 63-bit generator seed from several integers (a hash, so nearby inputs give unrelated streams)."""
    digest = hashlib.sha256(",".join(map(str, numbers)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
