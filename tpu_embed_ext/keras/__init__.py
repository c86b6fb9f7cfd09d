"""The engine in Keras: the embedding layer, its weights and gradients, the
training model and the serving export.
"""
