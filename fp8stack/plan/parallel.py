"""A model's tensor-parallel plan as data: which module is sharded how. The model keeps its own plan beside it (as
torchtitan keeps parallelize_llama beside the Llama); the assembly turns it into styles, each converted module's
backend choosing its own (torchao's Float8 styles, say)."""

from dataclasses import dataclass, field

SHARD_KINDS = ("colwise", "rowwise", "sequence", "prepare_input")
"""How a module is sharded: torch's ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput."""


@dataclass(frozen=True)
class ShardAs:
    """How tensor parallelism shards one module: a SHARD_KINDS name and the torch style's layout arguments."""

    kind: str
    layouts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TensorParallelPlan:
    """A model's tensor-parallel plan, kept beside the model (as torchtitan keeps parallelize_llama): how to shard
    the modules outside the blocks and, by their names inside a block, those of every block of model.layers."""

    outside: dict[str, ShardAs]
    """fqn outside the blocks -> how to shard it."""
    block: dict[str, ShardAs]
    """Name inside a block -> how to shard it, in every block."""
