"""Training data in verl's RLHF parquet schema: `python -m tools.data --help`."""
