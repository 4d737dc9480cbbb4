"""The configuration tree (job.py) and the command-line options generated from it (flags.py)."""

from fp8stack.config.flags import (add_config_arguments, add_section_arguments, from_dict, from_overrides,
                                   job_from_args, load_config, parse_args, preset_names, to_dict)
from fp8stack.config.job import (ActivationCheckpointConfig, CheckpointConfig, ConfigError, DataConfig,
                                 DeepGemmConfig, JobConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelismConfig, TEConfig,
                                 TorchaoConfig, TrainingConfig, check_data_parallel_levers, check_expert_parallel,
                                 check_optimizer_moments, check_release_main_grads, recompute_blocks)

__all__ = ["ActivationCheckpointConfig", "CheckpointConfig", "ConfigError", "DataConfig", "DeepGemmConfig", "JobConfig",
           "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelismConfig", "TEConfig", "TorchaoConfig",
           "TrainingConfig", "add_config_arguments", "add_section_arguments", "check_data_parallel_levers",
           "check_expert_parallel", "check_optimizer_moments", "check_release_main_grads", "from_dict",
           "from_overrides", "job_from_args", "load_config", "parse_args", "preset_names", "recompute_blocks",
           "to_dict"]
