"""The TPU embedding engine emulated on CPU: update rules and the engine.

A regular package (not a namespace one), so ``setuptools.find_packages``
ships it and the API reference generator finds it.
"""
