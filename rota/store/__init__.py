"""The store: SQLite and PostgreSQL, the rows jobs become, an operator's queries, tokens,
and several servers' leases and notices.
"""
