"""The suites shipped with clbench (YAML files), installed as `clbench_suites` so that an
installed clbench finds them by name (`clbench.spec.suites.suite_dirs`)."""
