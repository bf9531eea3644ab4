"""tools.report: what a run's logs say once it ran: the per-step summary from its TensorBoard events, throughput
with the reference recipe's definitions (metrics) and the learning curves (`python -m tools.report.curves`).

It reads run directories only and imports nothing of tools.launch or tools.perf; the launcher prints the summary
and draws the curves at the end of a run (tests/launch/test_import_layers.py holds the rule).
"""
