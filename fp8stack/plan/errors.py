"""The plan room's error (bad user input, reported as a single line naming the fix) and warning."""


class PlanError(ValueError):
    """Invalid model description, recipe or policy option. The message says how to fix it."""


class PlanWarning(UserWarning):
    """A valid plan that is probably not what was meant (an FP8 recipe with little FP8); the message says why."""
