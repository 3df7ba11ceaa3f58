"""``python -m skippyd`` is the ``skippyd`` command."""

from .cli import main

main()
