"""Load tools against a running cluster: the `prefixserve-bench run|compare` client, workloads,
metrics and reports, and the soak and fuzz runs."""
