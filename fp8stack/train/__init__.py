"""Training: stdlib-text data (data.py), the loop (loop.py: plan -> assemble -> AdamW), checkpoints
(checkpoint.py), step-time statistics (timing.py). `python -m fp8stack.train` is the command line.

Nothing is imported here, so `fp8stack.train.timing` stays importable without torch."""
