"""What keras_parallel keeps on one model: one `ModelState`, `model._kp_state`.

Keras and torch track what is set on a model (layers, variables, modules);
keras_parallel's state holds none of those, so it is one plain object set
past their tracking, under one name that no Keras or user attribute has.
"""

#: The one attribute keras_parallel sets on a model.
STATE_ATTRIBUTE = "_kp_state"


class ModelState:
    """keras_parallel's state of one model.

    Attributes:
        binding: the `Binding` a `DistributedModel`'s `compile` made, or None.
        callback_binding: the `Binding` of the `ShardingCallback` last
            handed the model, or None (`describe` reads it).
        made: `{step kind: plan version}`: the plan each step function
            Keras made was made under (a step made under an older plan is
            made again).
        announce: whether the plan is printed once `fit` makes its step.
        overrides: the `Overrides` in force on the model, the oldest first
            (`overrides.py`).
        installed: the names those overrides put on the model.
        set_aside: what the model held on itself under those names.
        seeds_folded: torch: the rank was folded into the model's seed
            states once.
    """

    def __init__(self):
        self.binding = None
        self.callback_binding = None
        self.made = {}
        self.announce = False
        self.overrides = []
        self.installed = ()
        self.set_aside = {}
        self.seeds_folded = False


def state_of(model):
    """`model`'s `ModelState`, made on first use.

    Args:
        model: a `keras.Model`.

    Returns:
        The `ModelState` held at `model._kp_state`.
    """
    state = vars(model).get(STATE_ATTRIBUTE)
    if state is None:
        state = ModelState()
        # Past Keras's and torch's attribute tracking: nothing to track.
        object.__setattr__(model, STATE_ATTRIBUTE, state)
    return state


def binding_of(model):
    """The `Binding` a `DistributedModel`'s `compile` made for `model`, or None
    (one device, or a model that is not a `DistributedModel`)."""
    state = vars(model).get(STATE_ATTRIBUTE)
    return None if state is None else state.binding
