"""Inputs for an operator call that must leave the caller's inputs as they were (Operator.result_of gives a call's result
also for an operator that writes an input in place)."""


def fresh(op, inputs: dict) -> dict:
    """The inputs with the argument the operator writes in place (if any) copied, so that a call leaves the
    original as it was."""
    return {**inputs, op.mutates: inputs[op.mutates].clone()} if op.mutates else dict(inputs)
