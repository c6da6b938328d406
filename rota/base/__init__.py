"""The bottom every part shares: errors, ids, what JSON is accepted, the wire protocol,
spec files, and log lines as text.

It imports no other part of rota; the worker SDK and the producer clients use only this
of the rest.
"""
