"""`sluice check`: the adoption checklist (`checklist.py`) and its items: the client and shared helpers (`items.py`),
the API contract (`contract.py`), the startup path (`startup.py`), the versions each replica runs (`versions.py`)."""
