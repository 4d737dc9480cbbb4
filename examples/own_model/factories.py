"""The model of model.py and byte-level text batches as fp8stack's trainer takes them from a user:

    fp8stack ab --model-factory examples/own_model/factories.py:model --data examples/own_model/factories.py:data

model() builds the tiny size (the trainer seeds the RNG before calling it); data(...) returns batch(index), which
draws random windows of the standard library's source bytes from a generator seeded by (seed, split, index), so
every A/B arm and every resumed run reads the same batches. Nothing here imports fp8stack.
"""

import hashlib
import sysconfig
from pathlib import Path

import torch

from model import SIZES, Transformer

VALIDATION_EVERY = 10
"""Every tenth standard-library file (in sorted order) is validation text, the others training text."""


def model() -> Transformer:
    """model.py's Transformer at its tiny size, initialised."""
    transformer = Transformer(SIZES["tiny"])
    transformer.init_weights()
    return transformer


def data(*, split: str, seq_len: int, batch_size: int, seed: int, rank: int, ranks: int):
    """batch(index) -> (tokens, targets) [batch_size, seq_len] int64: this rank's rows of global batch `index`."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    chosen = [f for i, f in enumerate(files) if (i % VALIDATION_EVERY == 0) == (split == "validation")]
    text = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in chosen)[: 1 << 23]), dtype=torch.uint8)

    def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = hashlib.sha256(f"{seed},{split},{index}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "big") >> 1)
        starts = torch.randint(len(text) - seq_len - 1, (batch_size * ranks,), generator=generator)
        mine = starts[rank * batch_size:(rank + 1) * batch_size].tolist()
        windows = torch.stack([text[s:s + seq_len + 1] for s in mine]).long()
        return windows[:, :-1], windows[:, 1:]

    return batch
