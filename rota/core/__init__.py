"""The pure core: the job model, retry policy, the scheduler and the engine that decides
what happens next, as functions of (state, event, now) that return effects; the verdicts
behind cancel, retry, bulk actions and directives.

No I/O, no event loop, no clock: tests/house/test_layout.py checks the imports.
"""
