"""The worker SDK: a sans-I/O protocol core (link), the connection thread, and the
handlers' execution.
"""
