"""The training side: reading format-1 checkpoints, the reference math, converting to an HF folder."""
