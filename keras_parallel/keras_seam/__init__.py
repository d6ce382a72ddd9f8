"""The seam into Keras: what keras_parallel keeps on a model, the methods it
runs differently, the Keras objects it replaces, and where it reads Keras's
own runs (their callback lists, the batch a model is built from)."""
