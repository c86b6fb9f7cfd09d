"""The engine: the TPU embedding engine on CPU (``engine.CPUEmbedding``), with
its inputs (lookups), its step (updates, native/), its checks and replicas.
"""

# A regular package, not a namespace one, so that setuptools.find_packages
# ships it and the API reference generator (mkdocstrings) finds it.
