"""Load generation, workloads, metrics and reports."""
