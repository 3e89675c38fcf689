"""clbench's built-in continual-learning add-ons, installed as `clbench_addons` and registered
in the `clbench.addons` entry-point group exactly as a third party's: `replay`, `ewc`, `lwf` and
`merge`. Each composes with any method that trains on clbench's loop, and imports from clbench
only `clbench.api`."""
