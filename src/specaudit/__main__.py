"""`python -m specaudit` = the `specaudit` command."""

from specaudit.cli import main

main()
