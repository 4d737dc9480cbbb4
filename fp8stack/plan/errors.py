"""The one error type of the plan room: bad user input, reported as a single line naming the fix."""


class PlanError(ValueError):
    """Invalid model description, recipe or policy option. The message says how to fix it."""
