"""Built-in method plugins (installed as `clbench_methods`)."""
