"""What one training run measured."""

from dataclasses import dataclass, field


@dataclass
class TrainResult:
    """What one run measured (rank 0's view; losses are averaged over data-parallel ranks, memory is the largest of
    any rank's)."""

    config: dict
    """The resolved JobConfig, as plain data (fp8stack.config.to_dict)."""
    device: str
    """Device name ('cpu' or the GPU's name)."""
    dtype: str
    """Activation dtype used."""
    world_size: int
    """Processes in the run."""
    tokens_per_step: int
    """Tokens in one optimizer step over all data-parallel ranks."""
    plan_summary: dict
    """Plan.summary(): FLOPs per token and FP8 share."""
    first_step: int
    """Index of the first step this run took (non-zero after a resume)."""
    losses: list[float] = field(default_factory=list)
    """Training loss per step."""
    step_ms: list[float] = field(default_factory=list)
    """Wall time per step in milliseconds."""
    lrs: list[float] = field(default_factory=list)
    """Learning rate used per step."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm per step, before clipping."""
    tokens_per_s: float = 0.0
    """Throughput over the steady-state steps (see steady_state)."""
    val_loss: float | None = None
    """Mean validation loss after the last step."""
    peak_mem_gib: float | None = None
    """CUDA peak allocated memory, the largest over the ranks (None on a CPU)."""
    resident_mem_gib: float | None = None
    """CUDA memory still allocated after the last step, the largest over the ranks: what a run holds between steps
    (parameters, masters, optimizer state, gradient buffers, FP8 weight caches); the peak less this is the step's
    transient memory (activations, workspaces). None on a CPU."""
    max_rss_gib: float = 0.0
    """Peak resident memory of the process."""
    collectives: dict | None = None
    """Collectives per step (comm_stats.Collectives as a dict) when profile_collectives > 0."""
    activation_bytes_saved_per_step: float | None = None
    """With compress_activations: bytes the FP8 storage of saved activations saved per step (this rank)."""
    router: list[dict[str, float]] = field(default_factory=list)
    """Per step of an MoE model (empty otherwise): fp8stack.models.moe.router_statistics of its layers' routing,
    per layer ('layers.1.moe/imbalance') and over the layers ('imbalance': mean max/mean expert load)."""
    zero_fp8_weight_grads: list[list[str]] = field(default_factory=list)
    """Per checked step (the first fp8_grad_check_steps): FP8 weights whose whole gradient was zero (this rank)."""
    stopped_after: int | None = None
    """The step after which SIGTERM or SIGINT stopped the run (its per-step lists end there, no validation ran); None
    when it ran all its steps."""
