"""`fp8stack ab`: train the same model with the same seed and data under several recipes, each in a
fresh process, and say per FP8 arm whether to ship it or roll back, with the numbers behind it.

run: the command (options, arms in fresh processes, evidence after every arm); verdicts: how an arm is
judged against bf16; plot: the evidence's figure.
"""

from fp8stack.ab.run import AbConfig, add_ab_parser, arm_configs, chosen_names, comma_separated, main, run_ab
from fp8stack.ab.verdicts import GPU_LOSS_TOLERANCE, LAST_FRACTION, final_loss

__all__ = ["GPU_LOSS_TOLERANCE", "LAST_FRACTION", "AbConfig", "add_ab_parser", "arm_configs", "chosen_names",
           "comma_separated", "final_loss", "main", "run_ab"]
