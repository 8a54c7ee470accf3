"""The generated docs and their checks, one module per document family.

* :mod:`kvoffload_ref.docgen.diagram` -- the lifecycle state machines as Mermaid text (``kvoffload-ref diagram``);
* :mod:`kvoffload_ref.docgen.spec` -- docs/spec.md's generated test lists and lifecycle diagrams
  (``kvoffload-ref spec``);
* :mod:`kvoffload_ref.docgen.failure_modes` -- the failure-modes table and README's guarantees table, produced
  by running the scenarios (``kvoffload-ref failure-modes``);
* :mod:`kvoffload_ref.docgen.fault_table` -- docs/simulator.md's fault table (each fault point x kind: where it
  fires and what the caller sees), measured on both workers.
"""
