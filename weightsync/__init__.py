"""weightsync: keep inference engines in step with a sharded PyTorch trainer across environments.

The core needs only torch (and ray where it launches actors); engines live in `backends/`.
Start at `worker.py` (trainer side), `sender.py`/`receiver.py` (one sync), `wire.py` (what
crosses), `launcher.py` and `envs.py` (who runs where).
"""

__version__ = "0.1.0"
