"""tools.perf: a model of a run's cost from its config, in pure functions: step time per phase (timing, over the
rollout simulator, fitted on the published reference runs), memory per die, and checkpoint size and write time.

It reads a run through the launcher's settings (tools.launch.config, keys, layout) and imports nothing else of
tools.launch; the launcher's preflight and dry run call it (tests/launch/test_import_layers.py holds the rule).
"""
