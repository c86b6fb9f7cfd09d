"""The TPU embedding engine emulated on CPU (``engine.CPUEmbedding``).

A regular package, not a namespace one, so that ``setuptools.find_packages``
ships it and the API reference generator (mkdocstrings) finds it.
"""
