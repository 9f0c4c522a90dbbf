"""stagemesh: the command that starts things. `stagemesh serve|router|stage|gateway|generate|
ask|fetch-model`, the local launcher and the in-process mesh handle for tests and benchmarks.

The top layer: it imports the services (`router`, `stage_worker`, `gateway`) and the
`foundation` they share; nothing below imports it (docs/ARCHITECTURE.md, "Layers").
"""

__version__ = "0.1.0"
