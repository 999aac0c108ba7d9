"""The shared-memory engine as it was before the split and the folded identity exchange
(commit d32c23f), loaded beside the current one so both run in the same job."""

import importlib.util
import os
import subprocess
import sys
import tempfile

REV = "d32c23f"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load():
    src = subprocess.run(["git", "-C", ROOT, "show", f"{REV}:ddl-core/ddl/engines/shm.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="ddl-old-shm-"), "shm_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("ddl.engines.shm_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ddl.engines.shm_old"] = mod
    spec.loader.exec_module(mod)
    return mod
