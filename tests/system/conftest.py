import shutil

import pytest

needs_mosquitto = pytest.mark.skipif(
    shutil.which("mosquitto") is None and not __import__("os").path.exists("/usr/sbin/mosquitto"),
    reason="mosquitto not installed (apt-get install -y mosquitto)",
)
