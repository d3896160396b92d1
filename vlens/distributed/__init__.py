"""Tensor parallelism: `parallel` (a rank's share, the collectives), `taps` (hooks that read and edit
sharded activations as whole ones), `worker` (what ranks 1.. run) and `executor` (what rank 0 drives)."""
