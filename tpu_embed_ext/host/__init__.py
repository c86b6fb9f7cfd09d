"""The host's files and process: outputs written atomically, the model
directory, checkpoint scans, host memory and library log streams.
"""
