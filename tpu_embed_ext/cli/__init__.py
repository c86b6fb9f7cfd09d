"""The command line: ``python -m tpu_embed_ext`` and its commands, console
output, ``plan`` and the reports it prints.
"""
