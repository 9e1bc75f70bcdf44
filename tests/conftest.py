import os
import sys

# tests import the shared harness as a plain module
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "autoshard-inductor"))
