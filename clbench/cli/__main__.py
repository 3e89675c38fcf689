"""`python -m clbench.cli ...` (how `accelerate launch` and `clbench sweep --jobs` start runs)."""

from clbench.cli import main

main()
