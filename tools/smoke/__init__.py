"""tools.smoke: the recipe end to end on this machine's CPUs (`python -m tools.smoke --help`): it makes the tiny
model, the task and the warm start with tools.weights and tools.data, then runs `python -m tools.launch`."""
