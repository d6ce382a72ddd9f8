"""What keras_parallel puts in force around one entry point, and the
processes' shared view of it: the binding of a distribution to a model, the
run, the heartbeat, the stall watch, process 0's writes."""
