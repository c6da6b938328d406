"""The producer clients: synchronous, asyncio, and the event stream's reader.
"""
