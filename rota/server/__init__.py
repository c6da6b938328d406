"""The server: the shell (the Coordinator and its parts) applies the core's effects, commit
then send; the HTTP routes, the /work sessions, the dashboard and the cluster call it.
"""
