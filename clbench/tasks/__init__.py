"""Task sources and graders; the contract lives in `clbench.tasks.base`."""
