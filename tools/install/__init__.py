"""Install the whole stack in order for a device profile (npu, cuda, cpu): `python -m tools.install`."""
