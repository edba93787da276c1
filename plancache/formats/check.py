"""The check record stored with each entry: how its choice was checked against the other
candidates. Written by autotuning (``autotuning.consensus``), read by the store, which
serves only what was checked under the current rule.
"""

__all__ = ["CHECK_RULE"]

#: The rule by which a stored choice must have been checked against the other candidates
#: to be served (``autotuning.consensus``, which records it with each check): 1 compared each
#: output's largest difference with its largest value, and could not see an engine wrong
#: on part of the output; 2 compares every element with its own bound.
CHECK_RULE = 2
