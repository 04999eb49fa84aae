"""Training workloads run by openlab's pipeline stages (no orchestration code lives here)."""
