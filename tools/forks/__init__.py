"""Pinned upstream forks and their patch series: sync, apply, export, check, rebase, publish.

Standard library only: it runs before anything else of the stack is installed.
"""
