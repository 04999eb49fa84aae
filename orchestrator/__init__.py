"""openlab's library: lineage, provenance, stage identity, launchers and links.

Every part of openlab records into and reads from the lineage store
(:mod:`orchestrator.lineage`); provenance capture (:mod:`orchestrator.provenance`),
data snapshots (:mod:`orchestrator.snapshots`) and stage identity
(:mod:`orchestrator.identity`) produce the facts it records.
"""

__version__ = "0.1.0"
