"""Rota: a job coordinator. Workers hold one WebSocket; the server pushes them jobs."""

from rota.context import JobContext, JobFailed
from rota.specs import JobSpec, checksum
from rota.worker import Worker

__version__ = "0.1.0"
__all__ = ["JobContext", "JobFailed", "JobSpec", "Worker", "__version__", "checksum"]
