"""scikit-learn, kept out of the processes the tests launch.

`import keras` imports scikit-learn when it is installed (for
`keras.wrappers`), about 1.8 of the 6 CPU-seconds a process spends
importing Keras on JAX (measured 2026-12-02, AMD EPYC, 2 cores). No
launched test process uses it: only the demo's digits do, and the tests
that run the demo or a documented example launch with it
(`subprocesses.checkout_env(scikit_learn=True)`). Keras imports it as
optional and does without it, as on a machine where it is not installed.
"""

raise ImportError(
    "scikit-learn is kept out of the processes the tests launch "
    "(tests/without_scikit_learn). Received: an import of sklearn in one; "
    "launch it with subprocesses.checkout_env(scikit_learn=True) instead."
)
