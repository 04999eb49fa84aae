"""Two-way links between lineage and the places people look at experiments.

- :mod:`orchestrator.links.github`: the experiment issue (resolved at start, one
  lineage-card comment per pipeline run, state labels, a durable queue when GitHub
  cannot be reached);
- :mod:`orchestrator.links.wandb`: the W&B run of each stage (deterministic id from the
  stage identity, lineage ids in its config, summary metrics read back into lineage);
- :mod:`orchestrator.links.wandb_init`: the tiny helper a job imports to start its run
  (no Prefect or database imports, so it is cheap inside a container).

Submodules are imported on use; importing this package costs nothing.
"""
