"""How long ``openlab gc`` keeps stage outputs unless told otherwise.

The collector (:mod:`orchestrator.pipeline.gc`) and the command's ``--help`` show the same
defaults, and the help must not load lineage and the pipeline executor to print three numbers
(that alone made every ``openlab`` command start half a second slower). Both take them from here.
"""

from __future__ import annotations

#: How many of each recipe and replica's last completed pipeline runs keep their outputs.
DEFAULT_KEEP_LAST = 3
#: Outputs made or reused more recently than this are kept.
DEFAULT_UNUSED_FOR = "7d"
#: With ``include_failed``: partial outputs of identities attempted more recently than this are kept
#: (longer than ``DEFAULT_UNUSED_FOR``: they are what a retry of a crashed run resumes from).
DEFAULT_FAILED_UNUSED_FOR = "30d"
