"""Installs the tests' checkout guard (tests/checkout_guard.py) in a Python process a test started; then hands over
to the sitecustomize this one shadows, if the environment has one."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_here))
try:
    import checkout_guard

    checkout_guard.install_in_subprocess()
finally:
    sys.path.remove(os.path.dirname(_here))
    sys.modules.pop("checkout_guard", None)

_shadowed = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _shadowed is not None:
    _module = importlib.util.module_from_spec(_shadowed)
    _shadowed.loader.exec_module(_module)
