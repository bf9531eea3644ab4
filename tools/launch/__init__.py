"""tools.launch: resolve a recipe config, check it (preflight), plan and run it on a Ray cluster."""
