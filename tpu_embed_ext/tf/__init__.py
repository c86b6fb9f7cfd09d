"""The spec as TensorFlow's objects: ``FeatureConfig``s, TPU embedding
optimizers, Keras optimizers read back, and learning-rate tags.
"""
