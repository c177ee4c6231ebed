import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("runtime", "operator"):
    sys.path.insert(0, str(ROOT / pkg))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
