"""Rota: a job coordinator. Workers hold one WebSocket; the server pushes them jobs."""

from rota.specs import JobSpec, checksum
from rota.worker import JobContext, Worker

__version__ = "0.1.0"
__all__ = ["JobContext", "JobSpec", "Worker", "__version__", "checksum"]
