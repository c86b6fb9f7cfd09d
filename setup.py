"""Packaging for tpu_embed_ext.

TensorFlow is deliberately not in ``install_requires``: a Cloud TPU VM ships
``tensorflow-tpu``, CI uses ``tensorflow-cpu``, workstations use
``tensorflow``. All three provide the same ``tensorflow`` module under
different distribution names, and pip cannot express "any one of them", so a
hard requirement would pull a second TensorFlow onto a machine that has one.
Pick the flavour with an extra (``pip install tpu_embed_ext[cpu]``), or
install none and keep the TensorFlow you have; importing the package without
any TensorFlow raises an error that says which extra to use.
"""

import setuptools

_TF = ">=2.16,<3"  # 2.16 is the first release whose tf.keras is Keras 3.
# TensorFlow (2.21 and earlier) writes a bool into an enum field of the TPU
# embedding config (OptimizationParameters.low_dimensional_packing_status)
# for every table; protobuf 7 refuses that with a TypeError, so TPUEmbedding
# cannot build on a TPU with it (TensorFlow itself allows protobuf < 8).
_PROTOBUF = "protobuf<7"
# mkdocs 1.6 added the `validation` settings that make --strict fail on a
# broken anchor (mkdocs.yml).
_DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26",
         "pymdown-extensions>=10"]

setuptools.setup(
    name="tpu_embed_ext",
    version="0.1.0",
    description=(
        "Per-table optimizers, schedule-to-tag mapping and a training CPU "
        "emulator for tf.tpu.experimental.embedding."
    ),
    python_requires=">=3.10",
    packages=setuptools.find_packages(include=["tpu_embed_ext", "tpu_embed_ext.*"])
    + ["tpu_embed_ext.configs"],
    # The shipped configs stay in the clone's top-level configs/ and install as
    # tpu_embed_ext/configs/, so `--config tiny` works wherever the package
    # is installed (tpu_embed_ext/spec/files.py: shipped_configs).
    package_dir={"tpu_embed_ext.configs": "configs"},
    # The native kernels' sources, compiled on first use against the
    # installed TensorFlow (tpu_embed_ext/emulation/native/loader.py).
    package_data={"tpu_embed_ext.emulation.native": ["*.cc"],
                  "tpu_embed_ext.configs": ["*.yaml"]},
    install_requires=[
        "absl-py>=1.0",
        "numpy>=1.23",
        "PyYAML>=6.0",
        "keras>=3.0",
    ],
    extras_require={
        "cpu": [f"tensorflow-cpu{_TF}", _PROTOBUF],
        "tf": [f"tensorflow{_TF}", _PROTOBUF],
        "tpu": [f"tensorflow-tpu{_TF}", _PROTOBUF],
        # The training job: tfds (which imports importlib_resources without
        # declaring it), the learning-curve plot and TensorBoard logs.
        "data": ["tensorflow-datasets>=4.9", "importlib_resources", "matplotlib>=3.5",
                 "tensorboard"],
        # `make bench`: keras-rs is one of the contenders (skipped where it
        # does not install: it needs Python >= 3.11).
        "bench": ["keras-rs>=0.2; python_version >= '3.11'", "matplotlib>=3.5"],
        # `make docs`: the MkDocs site with its API reference.
        "docs": _DOCS,
        "test": [
            "pytest>=7",
            # `make test` runs the suite on two processes, a test file each.
            "pytest-xdist>=3",
            "hypothesis>=6",
            "nbclient>=0.7",
            "nbformat>=5",
            "ipykernel>=6",
            "tensorflow-datasets>=4.9",
            "importlib_resources",
            "matplotlib>=3.5",
            "tensorboard",
            # tests/test_emulate_command.py: files a script leaves open survive
            # the runner's exit as they survive `python SCRIPT`'s.
            "h5py>=3",
            # The benchmark contenders' equivalence test covers keras-rs too.
            "keras-rs>=0.2; python_version >= '3.11'",
            # tests/test_docs.py builds the site with --strict.
            *_DOCS,
        ],
    },
    entry_points={"console_scripts": ["tpu-embed=tpu_embed_ext.cli.main:run"],
                  # `pytest --emulate-tpu=N` and the emulated_tpu fixture.
                  "pytest11": ["tpu_embed_ext = tpu_embed_ext.emulated_tpu.pytest_plugin"]},
)
