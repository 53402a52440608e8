"""Test-session defaults: no test may reach the model hub (CI machines are offline)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
