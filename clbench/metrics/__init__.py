"""Pure metric functions: continual (accuracy matrix), drift, artifacts."""
