"""TensorFlow, kept out of the JAX and torch processes the tests launch.

`keras.utils.set_random_seed` imports TensorFlow whenever it is installed
(to seed `tf.data`), and the JAX and torch envs install it for their
`tf.data` cases: about 3 of the 5.3 CPU-seconds a JAX process spends
importing Keras and seeding (measured 2026-12-03, AMD EPYC, 2 cores).
A launched process that feeds no `tf.data` pipeline does not need it;
those that do launch with `subprocesses.checkout_env(tensorflow=True)`.
Keras imports it as optional and does without it, as on a machine where it
is not installed.
"""

raise ImportError(
    "TensorFlow is kept out of the JAX and torch processes the tests launch "
    "(tests/without_tensorflow). Received: an import of tensorflow in one; "
    "launch it with subprocesses.checkout_env(tensorflow=True) instead."
)
