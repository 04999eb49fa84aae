"""openlab's library: lineage, provenance, stage identity, launchers and links.

Every part of openlab records into and reads from the lineage store
(:mod:`orchestrator.lineage`); provenance capture (:mod:`orchestrator.provenance`),
data snapshots (:mod:`orchestrator.snapshots`) and stage identity
(:mod:`orchestrator.identity`) produce the facts it records.
"""

from orchestrator.secrets import mask_secrets_in_logs

__version__ = "0.1.0"

# Whoever imports any part of openlab gets log records with secret values masked (see there why).
mask_secrets_in_logs()
