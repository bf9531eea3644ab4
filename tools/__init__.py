"""Project tools, one subpackage per job: `python -m tools.<job> --help`."""
