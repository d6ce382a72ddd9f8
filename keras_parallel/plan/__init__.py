"""The sharding plan, the same on every backend: where every variable
and constrained output lives, from a distribution and a built model."""
