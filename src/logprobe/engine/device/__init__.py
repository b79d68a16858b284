"""Picking and steering on the device, after a runner's pass: the batched sampler (`sampler.py`), the
instruments' columns (`instruments.py`), a steered request's processed distribution and masks
(`steering.py`, `grammar_masks.py`: the masks computed on a worker thread beside the pass), and a token
tree's children (`tree_passes.py`)."""
