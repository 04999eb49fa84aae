"""Prefect flows for openlab: thin wrappers that call the pipeline library.

Everything that decides *what* runs (identities, leases, launchers, lineage) lives in
``orchestrator``; these flows only map it onto Prefect tasks, logs, artifacts,
deployments and cancellation, so ``openlab run`` and a UI-triggered run behave alike.
"""
